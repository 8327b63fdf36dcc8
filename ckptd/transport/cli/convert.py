"""Protobuf messages -> JSON-able dicts for ``ckptctl --json`` (and for the human renderer).

Unlike ``json_format.MessageToDict`` this keeps 64-bit integers as JSON numbers (the proto3
JSON mapping turns them into strings, which makes ``bytes`` awkward to use from ``jq``) and
uses the proto field names. Every field of a message is present, set or not; a
``google.protobuf.Timestamp`` becomes an ISO 8601 UTC string (``2024-05-01T12:00:00Z``), or
``None`` when unset, as does any other unset sub-message.
"""

from __future__ import annotations

import base64
from typing import Any, cast

from google.protobuf import timestamp_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb

_TIMESTAMP = timestamp_pb2.Timestamp.DESCRIPTOR.full_name


def timestamp_to_iso(ts: timestamp_pb2.Timestamp) -> str:
    """``Timestamp`` -> RFC 3339 / ISO 8601 UTC, e.g. ``2024-05-01T12:00:00.250Z``."""
    return ts.ToJsonString()


def message_to_dict(msg: Message) -> dict[str, Any]:
    """Every field of ``msg`` by its proto name, converted with :func:`_value`."""
    out: dict[str, Any] = {}
    for field in cast(list[FieldDescriptor], list(msg.DESCRIPTOR.fields)):
        value = getattr(msg, field.name)
        if _is_map(field):
            value_field = _message_type(field).fields_by_name["value"]
            out[field.name] = {key: _value(value_field, value[key]) for key in sorted(value)}
        elif field.is_repeated:
            out[field.name] = [_value(field, item) for item in value]
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not msg.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _value(field, value)
    return out


def _message_type(field: FieldDescriptor) -> Descriptor:
    if field.message_type is None:  # pragma: no cover - only asked of message fields
        raise TypeError(f"{field.full_name} is not a message field")
    return field.message_type


def _is_map(field: FieldDescriptor) -> bool:
    return bool(
        field.is_repeated
        and field.type == FieldDescriptor.TYPE_MESSAGE
        and _message_type(field).GetOptions().map_entry
    )


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if _message_type(field).full_name == _TIMESTAMP:
            return timestamp_to_iso(value)
        return message_to_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM and field.enum_type is not None:
        enum_value = field.enum_type.values_by_number.get(value)
        return enum_value.name if enum_value is not None else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode("ascii")
    return value


def checkpoint_to_dict(ck: pb.Checkpoint) -> dict[str, Any]:
    """All fields of ``Checkpoint``; ``created`` as an ISO 8601 UTC string (``None`` if unset)."""
    return message_to_dict(ck)


def checkpoints_to_list(response: pb.ListResponse) -> list[dict[str, Any]]:
    return [checkpoint_to_dict(ck) for ck in response.checkpoints]


def restore_result_to_dict(result: pb.RestoreResult) -> dict[str, Any]:
    """``{"id", "pid", "output_path", "duration_s", "stdio", "files_put_back",
    "files_kept", "files_left", "lazy"}``; ``pid`` is the restored root."""
    return {
        "id": result.checkpoint_id,
        "pid": result.pid,
        "output_path": result.output_path,
        "duration_s": result.duration_s,
        "stdio": [message_to_dict(s) for s in result.stdio],
        "files_put_back": list(result.files_put_back),
        "files_kept": list(result.files_kept),
        "files_left": list(result.files_left),
        "lazy": result.lazy,
    }


def delete_to_dict(response: pb.DeleteResponse, requested_id: str) -> dict[str, Any]:
    return {"id": response.id or requested_id}


def check_to_dict(response: pb.CheckResponse) -> dict[str, Any]:
    return message_to_dict(response)
