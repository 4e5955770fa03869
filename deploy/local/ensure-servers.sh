#!/usr/bin/env bash
# Make sure RabbitMQ (with the management plugin) and PostgreSQL answer on 127.0.0.1.
# Starts local servers that are installed but stopped; otherwise explains exactly how to get them.
# Idempotent; safe to run before every `make demo` / `make test`.
set -uo pipefail

AMQP_PORT=${GPUORCH_AMQP_PORT:-5672}
PG_PORT=${GPUORCH_PG_PORT:-5432}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() { # port seconds
  for _ in $(seq 1 "$2"); do port_open "$1" && return 0; sleep 1; done
  return 1
}

explain() {
  cat >&2 <<TXT
gpuorch needs RabbitMQ on 127.0.0.1:${AMQP_PORT} (guest/guest, management plugin) and PostgreSQL on
127.0.0.1:${PG_PORT} (user postgres, trust auth on localhost). Either:
  - on Debian/Ubuntu:  sudo apt-get install -y rabbitmq-server postgresql   then run this again; or
  - with Docker:       docker compose -f deploy/compose.yaml up -d rabbitmq postgres
TXT
  exit 1
}

# --- RabbitMQ ---------------------------------------------------------------------------------------------
if ! port_open "$AMQP_PORT"; then
  if command -v rabbitmq-server >/dev/null 2>&1; then
    echo "starting RabbitMQ ..." >&2
    rabbitmq-server -detached >/dev/null 2>&1 || true
    wait_port "$AMQP_PORT" 60 || { echo "RabbitMQ did not start" >&2; explain; }
  else
    echo "RabbitMQ is not running and not installed." >&2; explain
  fi
fi
if ! port_open 15672; then
  if command -v rabbitmq-plugins >/dev/null 2>&1; then
    echo "enabling the RabbitMQ management plugin ..." >&2
    rabbitmq-plugins enable rabbitmq_management >/dev/null 2>&1 || true
    wait_port 15672 60 || echo "warning: management API not reachable on 15672 (tests need it)" >&2
  fi
fi

# --- PostgreSQL -------------------------------------------------------------------------------------------
if ! port_open "$PG_PORT"; then
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    echo "starting PostgreSQL ..." >&2
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    pg_ctlcluster --skip-systemctl-redirect "$version" main start >/dev/null 2>&1 || \
      pg_ctlcluster "$version" main start >/dev/null 2>&1 || true
    wait_port "$PG_PORT" 60 || { echo "PostgreSQL did not start" >&2; explain; }
  else
    echo "PostgreSQL is not running and not installed." >&2; explain
  fi
fi
if command -v psql >/dev/null 2>&1 && ! psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -Atc 'select 1' >/dev/null 2>&1; then
  echo "PostgreSQL refuses passwordless login for postgres@127.0.0.1; on a disposable dev/CI machine run:" >&2
  echo "  deploy/local/trust-localhost.sh   (sets trust auth for 127.0.0.1 in pg_hba.conf and reloads)" >&2
  exit 1
fi
echo "RabbitMQ and PostgreSQL are up." >&2
