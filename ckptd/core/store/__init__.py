"""The content-addressed checkpoint store: pages hashed, deduplicated, zstd-compressed in packs.

Format (all integers little-endian; see docs/store-format.md):

    store.json                      {"format": 1, "secret": hex}   (created once, 0600)
    packs/<2 hex>/<pack id>         zstd frames of pages + a trailer naming every page
    blobs/<2 hex>/<hash>            a whole CRIU metadata image or page list, zstd-compressed
    manifests/<checkpoint id>       the checkpoint: record, files, page lists (written last;
                                    HMAC-SHA256 under a node-held key, ADR 0014)
    leases/<operation id>           a dump in progress (GC keeps what it may reference)
"""
