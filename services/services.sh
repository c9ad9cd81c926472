#!/usr/bin/env bash
# Real Kafka (single-node KRaft) + PostgreSQL, run natively on 127.0.0.1 for tests and benchmarks.
#   start              start both (no-op for one already healthy), wait until usable, print the exports
#   stop               stop both cleanly                 env      print the exports (for eval)
#   restart-kafka      stop + start, keeping data; returns once usable again
#   restart-postgres   same for PostgreSQL               status   say what is up
#   stop-postgres, start-postgres   one at a time (a test of what a worker does while it is down)
# State (data, logs, pids): ${ETL_SERVICES_DIR:-/tmp/idem-etl-services}. Ports: ETL_KAFKA_PORT (19092;
# controller +1, or ETL_KAFKA_CONTROLLER_PORT), ETL_PG_PORT (25432). Only the exports go to stdout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
KAFKA_PORT=${ETL_KAFKA_PORT:-19092}
CTRL_PORT=${ETL_KAFKA_CONTROLLER_PORT:-$((KAFKA_PORT + 1))}
PG_PORT=${ETL_PG_PORT:-25432}
TIMEOUT=${ETL_SERVICES_TIMEOUT:-90}   # seconds a service gets to become ready
LIBS=$HERE/kafka/libs
mkdir -p "${ETL_SERVICES_DIR:-/tmp/idem-etl-services}"
STATE=$(cd "${ETL_SERVICES_DIR:-/tmp/idem-etl-services}" && pwd)
KDIR=$STATE/kafka PGDIR=$STATE/postgres
cd /   # all paths are absolute; also spares the postgres user "cannot change directory" warnings

log() { echo "services.sh: $*" >&2; }
die() { echo "services.sh: ERROR: $*" >&2; exit 1; }
fail() {  # fail LOGFILE MESSAGE: the log's tail, then the one-line error last, where CI output ends
  { echo "----- tail of $1 -----"; tail -n 40 "$1" 2>/dev/null; echo "-----"; } >&2; die "$2"
}
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
print_env() {
  echo "export ETL_TEST_KAFKA=127.0.0.1:$KAFKA_PORT"
  echo "export ETL_TEST_POSTGRES_URL=postgresql+psycopg://etl:etl@127.0.0.1:$PG_PORT/etl"
}

# ------------------------------------------------------------------------------------------ Kafka
# The pid file counts only while that pid is a kafka.Kafka JVM (pid reuse; a zombie's cmdline is empty).
kafka_pid() {
  local p; p=$(cat "$KDIR/kafka.pid" 2>/dev/null) || return 1
  grep -qa 'kafka\.Kafka' "/proc/$p/cmdline" 2>/dev/null && echo "$p"
}

ensure_kafka_libs() {  # libs/.complete = checksum of the pom they came from; refetch if missing/partial/stale
  local sum; sum=$(sha256sum "$HERE/kafka/pom.xml" | cut -d' ' -f1)
  [ "$(cat "$LIBS/.complete" 2>/dev/null)" = "$sum" ] && return 0
  command -v mvn >/dev/null || die "mvn not found (needed once to fetch the Kafka jars into $LIBS)"
  log "fetching Kafka jars from Maven Central into $LIBS"
  rm -rf "$LIBS.tmp"
  (cd "$HERE/kafka" && mvn -q -B -Dstyle.color=never dependency:copy-dependencies \
      -DoutputDirectory="$LIBS.tmp" -DincludeScope=runtime) >&2 || die "mvn could not fetch the Kafka jars"
  rm -rf "$LIBS" && mv "$LIBS.tmp" "$LIBS" && echo "$sum" > "$LIBS/.complete"
}

kjava() { java -Dlog4j2.configurationFile="$HERE/kafka/log4j2.properties" -cp "$LIBS/*" "$@"; }

launch_kafka() {  # starts the JVM in the background; wait_kafka does the waiting
  kafka_pid >/dev/null && return 0
  command -v java >/dev/null || die "java not found (Kafka needs Java 17+)"
  ensure_kafka_libs
  mkdir -p "$KDIR"
  port_open "$KAFKA_PORT" && die "port $KAFKA_PORT is taken by a process this script did not start"
  port_open "$CTRL_PORT" && die "port $CTRL_PORT is taken by a process this script did not start"
  # A config copy for this state dir and these ports; the tracked server.properties is the template.
  local h=127.0.0.1
  sed -e "s#^log\.dirs=.*#log.dirs=$KDIR/data#" \
      -e "s#^listeners=.*#listeners=PLAINTEXT://$h:$KAFKA_PORT,CONTROLLER://$h:$CTRL_PORT#" \
      -e "s#^advertised\.listeners=.*#advertised.listeners=PLAINTEXT://$h:$KAFKA_PORT#" \
      -e "s#^controller\.quorum\.bootstrap\.servers=.*#controller.quorum.bootstrap.servers=$h:$CTRL_PORT#" \
      "$HERE/kafka/server.properties" > "$KDIR/server.properties"
  [ -f "$KDIR/kafka.log" ] && mv -f "$KDIR/kafka.log" "$KDIR/kafka.log.prev"
  # Format once. The stamp holds the ports: --standalone writes the controller's address into the
  # metadata log, so data formatted for other ports (or a half-done format) is wiped and redone.
  if [ "$(cat "$KDIR/formatted" 2>/dev/null)" != "$KAFKA_PORT/$CTRL_PORT" ]; then
    [ -e "$KDIR/formatted" ] && log "Kafka ports changed: wiping $KDIR/data"
    rm -rf "$KDIR/data" "$KDIR/formatted"
    local cid; cid=$(kjava kafka.tools.StorageTool random-uuid)
    kjava kafka.tools.StorageTool format --standalone -t "$cid" -c "$KDIR/server.properties" \
      >> "$KDIR/kafka.log" 2>&1 || fail "$KDIR/kafka.log" "formatting Kafka storage failed"
    echo "$KAFKA_PORT/$CTRL_PORT" > "$KDIR/formatted"
  fi
  # setsid: own session, so CI cleaning up this script's process group leaves the broker alone.
  # 9>&-: the daemon must not inherit (and so hold) the script's lock.
  nohup setsid java -Xms256m -Xmx512m -XX:+UseG1GC -Djava.awt.headless=true -Djava.net.preferIPv4Stack=true \
    -Dlog4j2.configurationFile="$HERE/kafka/log4j2.properties" -Dkafka.logs.dir="$KDIR/logs" \
    -cp "$LIBS/*" kafka.Kafka "$KDIR/server.properties" >> "$KDIR/kafka.log" 2>&1 < /dev/null 9>&- &
  echo $! > "$KDIR/kafka.pid"
}

# Ready = port open and "Kafka Server started" logged (KafkaRaftServer logs it once the broker is
# unfenced), then, where some python has kafka-python, a metadata round trip that lists the broker.
PY=""
find_python() {
  local p
  for p in "${ETL_PYTHON:-}" "$REPO/.venv/bin/python" python3; do
    [ -n "$p" ] && "$p" -c 'import kafka' 2>/dev/null && { PY=$p; return 0; }
  done; return 0
}
kafka_usable() {
  [ -z "$PY" ] || "$PY" -c 'import sys; from kafka import KafkaAdminClient as A
sys.exit(not A(bootstrap_servers=sys.argv[1], request_timeout_ms=5000).describe_cluster()["brokers"])' \
    "127.0.0.1:$KAFKA_PORT" 2>/dev/null
}

wait_kafka() {
  local t0=$SECONDS started=""
  find_python
  while (( SECONDS - t0 < TIMEOUT )); do
    kafka_pid >/dev/null || fail "$KDIR/kafka.log" "Kafka exited while starting (log: $KDIR/kafka.log)"
    if port_open "$KAFKA_PORT" && grep -q 'Kafka Server started' "$KDIR/kafka.log"; then
      started=${started:-$SECONDS}
      kafka_usable && return 0
      # An odd kafka-python (e.g. one too old for Kafka 4) must not fail a broker that says it is up.
      (( SECONDS - started < 15 )) || { log "WARNING: the kafka-python check still fails; going on"; return 0; }
    fi
    sleep 0.3
  done
  fail "$KDIR/kafka.log" "Kafka not usable on 127.0.0.1:$KAFKA_PORT after ${TIMEOUT}s (log: $KDIR/kafka.log)"
}

stop_kafka() {
  local pid i
  if pid=$(kafka_pid); then
    kill -TERM "$pid" 2>/dev/null || true   # controlled shutdown: no log recovery at the next start
    for ((i = 0; i < 300; i++)); do kafka_pid >/dev/null || break; sleep 0.1; done
    if kafka_pid >/dev/null; then log "Kafka still up after 30s: killing it"; kill -KILL "$pid" || true; fi
  fi
  rm -f "$KDIR/kafka.pid"
}

# ------------------------------------------------------------------------------------- PostgreSQL
PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
# PostgreSQL refuses to run as root: as root, run its tools as the unprivileged "postgres" user.
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
# Running = the pid in postmaster.pid is a live postgres. Not pg_ctl status: it takes a zombie for a
# live server, and a postmaster killed with -9 can stay a zombie for a while (slow-reaping PID 1).
pg_running() {
  local pid; pid=$(head -n 1 "$PGDIR/data/postmaster.pid" 2>/dev/null) || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = postgres ] && ! grep -q '^State:.*Z' "/proc/$pid/status"
}
# For the same reason postgres refuses to start after such a crash. The lock files are stale once
# nothing is attached to the shared memory they name (postgres's own test): then remove them.
clear_stale_pg_lock() {
  local f=$PGDIR/data/postmaster.pid shmid nattch i
  [ -f "$f" ] || return 0
  shmid=$(sed -n 7p "$f" | awk '{print $2}')
  for ((i = 0; i < 100; i++)); do   # orphaned backends see the postmaster's death within moments
    nattch=$(ipcs -m | awk -v id="${shmid:-x}" '$2 == id {print $6}')
    if [ "${nattch:-0}" = 0 ]; then
      log "removing the lock files of a dead postmaster"; rm -f "$f" "$PGDIR"/run/.s.PGSQL.*.lock; return 0
    fi
    sleep 0.1
  done   # still attached: leave them, and postgres will say why it refuses to start
}

ensure_postgres_install() {
  if [ ! -x "$PGBIN/postgres" ]; then
    [ "$(id -u)" = 0 ] || die "no PostgreSQL server in /usr/lib/postgresql (install package postgresql)"
    log "installing PostgreSQL with apt-get"
    (export DEBIAN_FRONTEND=noninteractive; apt-get update -q && apt-get install -y -q postgresql) >&2 \
      || die "apt-get install postgresql failed"
    PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  fi
  mkdir -p "$PGDIR/run"
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home --shell /bin/sh postgres
    chown postgres: "$PGDIR" "$PGDIR/run"
  fi
  as_pg test -w "$PGDIR" || die "user postgres cannot write $PGDIR (parent not searchable?)"
}

start_postgres() {
  ensure_postgres_install
  if ! pg_running; then
    clear_stale_pg_lock
    port_open "$PG_PORT" && die "port $PG_PORT is taken by a process this script did not start"
    if [ ! -f "$PGDIR/data/PG_VERSION" ]; then   # first start, or a half-done initdb
      rm -rf "$PGDIR/data"
      as_pg "$PGBIN/initdb" -D "$PGDIR/data" -U postgres -E UTF8 --no-locale --auth-local=trust \
        --auth-host=scram-sha-256 > "$PGDIR/initdb.log" 2>&1 || fail "$PGDIR/initdb.log" "initdb failed"
    fi
    # Network settings on the command line, so a new ETL_PG_PORT needs no re-init.
    as_pg "$PGBIN/pg_ctl" -D "$PGDIR/data" -l "$PGDIR/postgres.log" -w -t "$TIMEOUT" \
      -o "-c listen_addresses=127.0.0.1 -c port=$PG_PORT -c unix_socket_directories='$PGDIR/run'" \
      start > /dev/null 9>&- || fail "$PGDIR/postgres.log" "PostgreSQL did not start (log: $PGDIR/postgres.log)"
  fi
  local t0=$SECONDS
  until "$PGBIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" -t 2; do
    (( SECONDS - t0 < TIMEOUT )) || fail "$PGDIR/postgres.log" "PostgreSQL not ready after ${TIMEOUT}s"
    sleep 0.3
  done
  # Role etl (not a superuser; CREATEROLE so tests can add e.g. a read-only analyst) and its database.
  as_pg "$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$PGDIR/run" -p "$PG_PORT" -U postgres -d postgres \
    > /dev/null <<'SQL' || fail "$PGDIR/postgres.log" "could not create role/database etl"
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'etl') THEN
    CREATE ROLE etl LOGIN CREATEROLE NOSUPERUSER PASSWORD 'etl';
  END IF;
END $$;
SELECT 'CREATE DATABASE etl OWNER etl' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'etl')
\gexec
SQL
}

stop_postgres() {
  pg_running || return 0
  as_pg "$PGBIN/pg_ctl" -D "$PGDIR/data" stop -m fast -w -t 60 > /dev/null
}

# ------------------------------------------------------------------------------------------- main
lock() {  # one start/stop/restart at a time per state dir (e.g. a test's restart racing a start)
  exec 9> "$STATE/.lock"
  flock -w 300 9 || die "another services.sh still holds $STATE/.lock"
}
up() { if "$@"; then echo up; else echo down; fi; }

case "${1:-}" in
  start)            lock; launch_kafka; start_postgres; wait_kafka; print_env ;;  # PG starts as the JVM boots
  stop)             lock; stop_kafka; stop_postgres ;;
  restart-kafka)    lock; stop_kafka; launch_kafka; wait_kafka ;;
  restart-postgres) lock; stop_postgres; start_postgres ;;
  stop-postgres)    lock; stop_postgres ;;
  start-postgres)   lock; start_postgres ;;
  env)              print_env ;;
  status)
    echo "kafka 127.0.0.1:$KAFKA_PORT: $(up eval 'kafka_pid >/dev/null && port_open "$KAFKA_PORT"')"
    echo "postgres 127.0.0.1:$PG_PORT: $(up "$PGBIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT")" ;;
  *) echo "usage: $0 start|stop|env|status|restart-kafka|restart-postgres|stop-postgres|start-postgres" >&2; exit 2 ;;
esac
