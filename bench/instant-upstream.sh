#!/bin/sh
# An upstream that answers at once, to isolate the proxy in the benchmark: nginx pretending to
# be llama-server (health, props with many slots, a fixed chat completion). Spillway starts it
# as a child with llama-server's arguments; only --port matters here.
set -eu
port=8080
case " $* " in *" --list-devices "*) echo "Available devices:"; echo "  (none)"; exit 0 ;; esac
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port="$2"; shift 2 ;;
    *) shift ;;
  esac
done
dir=$(mktemp -d)
cat > "$dir/nginx.conf" <<EOF
worker_processes 1;
pid $dir/nginx.pid;
error_log stderr warn;
daemon off;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir;
  keepalive_requests 100000;
  server {
    listen 127.0.0.1:$port;
    default_type application/json;
    location = /health { return 200 '{"status":"ok"}'; }
    location = /props { return 200 '{"default_generation_settings":{"n_ctx":8192},"total_slots":1024}'; }
    location / {
      return 200 '{"choices":[{"finish_reason":"length","index":0,"message":{"role":"assistant","content":"ok"}}],"object":"chat.completion","model":"instant","usage":{"completion_tokens":1,"prompt_tokens":5,"total_tokens":6}}';
    }
  }
}
EOF
exec nginx -c "$dir/nginx.conf" -p "$dir"
