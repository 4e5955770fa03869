#!/usr/bin/env bash
# For disposable dev/CI machines only: let postgres@127.0.0.1 log in without a password (trust auth).
set -euo pipefail
for hba in /etc/postgresql/*/main/pg_hba.conf; do
  if ! grep -q "gpuorch-trust" "$hba"; then
    tmp=$(mktemp)
    { echo "host all all 127.0.0.1/32 trust # gpuorch-trust"; echo "host all all ::1/128 trust # gpuorch-trust";
      cat "$hba"; } > "$tmp"
    cat "$tmp" > "$hba"; rm -f "$tmp"
  fi
done
version=$(ls /etc/postgresql | sort -V | tail -n 1)
pg_ctlcluster --skip-systemctl-redirect "$version" main reload 2>/dev/null || pg_ctlcluster "$version" main reload
