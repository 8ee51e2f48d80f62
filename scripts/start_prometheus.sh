#!/usr/bin/env bash
# Runs Prometheus (Debian's build, fetched by install_prometheus.sh) in the foreground, scraping a
# pdserve router's /metrics with configs/monitoring/pdserve-alerts.yml loaded. It listens on
# loopback: reach it through a tunnel (`ssh -L 9090:127.0.0.1:9090 HEAD`), and point Grafana at
# it to import configs/monitoring/pdserve-dashboard.json.
#   scripts/start_prometheus.sh [--target HOST:PORT] [--listen 127.0.0.1:9090]
#                               [--dir ~/.pdserve/prometheus] [--scrape-interval 15s]
# PDSERVE_API_KEY (the router's inference key, if it has one) is written to DIR/api_key (mode
# 600) and sent as the bearer token of each scrape.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=127.0.0.1:8000 listen=127.0.0.1:9090 dir="$HOME/.pdserve/prometheus" interval=15s
while [ $# -gt 0 ]; do
  case "$1" in
    --target) target=$2; shift 2 ;;
    --listen) listen=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --scrape-interval) interval=$2; shift 2 ;;
    *) echo "start_prometheus.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
bin=$(bash "$root/scripts/install_prometheus.sh")
mkdir -p "$dir/data"
auth=""
if [ -n "${PDSERVE_API_KEY:-}" ]; then
  (umask 077 && printf '%s' "$PDSERVE_API_KEY" > "$dir/api_key")
  auth="    authorization: {credentials_file: $dir/api_key}"
fi
cat > "$dir/prometheus.yml" <<YAML
global: {scrape_interval: $interval, evaluation_interval: $interval}
rule_files: [$root/configs/monitoring/pdserve-alerts.yml]
scrape_configs:
  - job_name: pdserve
    static_configs: [{targets: ["$target"]}]
$auth
YAML
"$bin/promtool" check config "$dir/prometheus.yml" >/dev/null
exec "$bin/prometheus" --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/data" \
  --web.listen-address="$listen" --log.level=warn
