#!/usr/bin/env bash
# Raw-SQL bounds of the write path, with pgbench: what each part of the outbox write costs on
# this machine without any Rust client in the way. Usage: run.sh [clients] [seconds]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
clients=${1:-16}
seconds=${2:-5}
db=handoff_pgbench_$$
psql -h 127.0.0.1 -U postgres -qc "CREATE DATABASE $db"
trap 'psql -h 127.0.0.1 -U postgres -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)"' EXIT
RUST_LOG=warn "$here/../../../target/release/handoff" migrate --database-url "postgres://postgres@127.0.0.1/$db" >/dev/null
psql -h 127.0.0.1 -U postgres -d "$db" -qf "$here/setup.sql"
for script in business_only outbox_same_statement outbox_separate_statement head_upsert_then_outbox; do
    psql -h 127.0.0.1 -U postgres -d "$db" -qc 'TRUNCATE t_orders, outbox, outbox_heads; CHECKPOINT'
    tps=$(pgbench -h 127.0.0.1 -U postgres -n -M prepared -c "$clients" -j 2 -T "$seconds" \
        -f "$here/$script.sql" "$db" | sed -n 's/^tps = \([0-9.]*\).*/\1/p')
    printf '%-28s %8.0f tps\n' "$script" "$tps"
done
