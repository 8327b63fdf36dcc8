#!/usr/bin/env bash
# Make a CA and one certificate per node for ckptd's daemon-to-daemon (migration) listener.
#
# Usage: scripts/make-peer-certs.sh DIR NODE=ADDR[,ADDR...] [NODE=ADDR...]
#   e.g. scripts/make-peer-certs.sh /etc/ckptd/pki gpu-a=10.0.0.11 gpu-b=10.0.0.12,gpu-b.lan
# Writes DIR/ca.pem (+ ca.key: keep it off the nodes) and DIR/NODE.pem + DIR/NODE.key for each
# node: an EC P-256 key, the addresses as subject alternative names (IPs or DNS names: the
# address other daemons dial must be among them), usable as TLS server and client. An existing
# CA in DIR is reused, so nodes can be added later. Then, in each node's /etc/ckptd/ckptd.toml:
#   peer_listen = "10.0.0.11:7443"
#   tls_cert = "/etc/ckptd/pki/gpu-a.pem"
#   tls_key = "/etc/ckptd/pki/gpu-a.key"
#   tls_ca = "/etc/ckptd/pki/ca.pem"
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,14p' "$0" >&2; exit 2; }
dir=$1; shift
mkdir -p "$dir"; chmod 700 "$dir"
if [ ! -s "$dir/ca.pem" ]; then
    openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 \
        -keyout "$dir/ca.key" -out "$dir/ca.pem" -days 3650 -subj "/CN=ckptd peer CA" \
        -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
        2>/dev/null
    chmod 600 "$dir/ca.key"
fi
for spec in "$@"; do
    node=${spec%%=*}; addrs=${spec#*=}
    [ -n "$node" ] && [ "$node" != "$spec" ] || { echo "bad node spec: $spec (NODE=ADDR)" >&2; exit 2; }
    san=""
    IFS=, read -ra list <<< "$addrs"
    for a in "${list[@]}"; do
        if [[ $a =~ ^[0-9.]+$ || $a == *:* ]]; then san+="IP:$a,"; else san+="DNS:$a,"; fi
    done
    openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 \
        -keyout "$dir/$node.key" -out "$dir/$node.csr" -subj "/CN=$node" 2>/dev/null
    openssl x509 -req -in "$dir/$node.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
        -CAcreateserial -out "$dir/$node.pem" -days 825 \
        -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=critical,digitalSignature\n' "${san%,}") \
        2>/dev/null
    rm -f "$dir/$node.csr"
    chmod 600 "$dir/$node.key"
    echo "$dir/$node.pem ($node: ${san%,})"
done
