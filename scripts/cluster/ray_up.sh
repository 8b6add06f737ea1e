#!/usr/bin/env bash
# Start one node of a Ray cluster for agentrl: the head on one host, a worker on each of the others.
#
#   ray_up.sh head   [options]                  # first host; prints what the workers and the job need
#   ray_up.sh worker --address HEAD_IP:PORT [options]
#   ray_up.sh ports                             # the fixed ports a node uses: open them between hosts
#
# Options (both roles):
#   --node-ip-address IP   this host's address the others reach (default: Ray picks one)
#   --resources JSON       custom resources, e.g. '{"engine_node": 8}' (see ray.*_resources)
#   --num-cpus N --num-gpus N
#   --temp-dir DIR         Ray's session files (default: Ray's, /tmp/ray)
#   --block                stay in the foreground; the node stops with this command (Ctrl-C, SIGTERM)
#   --port PORT            head only: the cluster's port (default 6379)
#   --dashboard            head only: start Ray's dashboard on port 8265
#   --token-file FILE      the cluster's token (default: $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token)
#   -- ARGS                anything else for `ray start`
#
# Ray's token authentication is always on: every node and the job need the same token. It comes from
# RAY_AUTH_TOKEN in the environment, else from the token file; the head writes a new one to the file when
# neither exists (copy that file to the other hosts). Every port is fixed (`ray_up.sh ports`) except the
# ones agentrl's servers take when the run starts (engines, retrieval, weight sync): open all TCP between
# the cluster's hosts, or at least those and the ephemeral range.
set -euo pipefail

# The fixed ports (`ray_up.sh ports` prints them; scripts/cluster/rayjob.yaml uses the same).
GCS_PORT=6379
NODE_MANAGER_PORT=6380
OBJECT_MANAGER_PORT=6381
DASHBOARD_AGENT_GRPC_PORT=6382
DASHBOARD_AGENT_LISTEN_PORT=6383
METRICS_EXPORT_PORT=6384
RUNTIME_ENV_AGENT_PORT=6385
DASHBOARD_PORT=8265
RAY_CLIENT_SERVER_PORT=10001
MIN_WORKER_PORT=10002
MAX_WORKER_PORT=10999

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

role=${1:-}
[[ $role == head || $role == worker || $role == ports ]] || usage
shift
if [[ $role == ports ]]; then
  for name in GCS_PORT NODE_MANAGER_PORT OBJECT_MANAGER_PORT DASHBOARD_AGENT_GRPC_PORT \
    DASHBOARD_AGENT_LISTEN_PORT METRICS_EXPORT_PORT RUNTIME_ENV_AGENT_PORT DASHBOARD_PORT \
    RAY_CLIENT_SERVER_PORT MIN_WORKER_PORT MAX_WORKER_PORT; do
    echo "$name=${!name}"
  done
  exit 0
fi

address="" ip="" resources="" cpus="" gpus="" temp_dir="" block=0 dashboard=0 extra=()
token_file=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}
while (($#)); do
  case $1 in
    --address) address=$2; shift 2 ;;
    --node-ip-address) ip=$2; shift 2 ;;
    --resources) resources=$2; shift 2 ;;
    --num-cpus) cpus=$2; shift 2 ;;
    --num-gpus) gpus=$2; shift 2 ;;
    --temp-dir) temp_dir=$2; shift 2 ;;
    --port) GCS_PORT=$2; shift 2 ;;
    --token-file) token_file=$2; shift 2 ;;
    --block) block=1; shift ;;
    --dashboard) dashboard=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "ray_up.sh: unknown option $1" >&2; usage ;;
  esac
done
[[ $role == head || -n $address ]] || { echo "ray_up.sh worker: --address HEAD_IP:PORT is required" >&2; exit 2; }

# The token: the environment's, else the file's; the head makes one when there is none.
if [[ -z ${RAY_AUTH_TOKEN:-} ]]; then
  if [[ ! -s $token_file ]]; then
    [[ $role == head ]] || { echo "ray_up.sh: no RAY_AUTH_TOKEN and no token file $token_file" \
      "(copy the head's)" >&2; exit 2; }
    mkdir -p "$(dirname "$token_file")"
    (umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32))' > "$token_file")
    echo "ray_up.sh: wrote a new cluster token to $token_file; copy it to every host" >&2
  fi
  export RAY_AUTH_TOKEN_PATH=$token_file
fi
export RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0

args=(--node-manager-port="$NODE_MANAGER_PORT" --object-manager-port="$OBJECT_MANAGER_PORT"
  --dashboard-agent-grpc-port="$DASHBOARD_AGENT_GRPC_PORT"
  --dashboard-agent-listen-port="$DASHBOARD_AGENT_LISTEN_PORT"
  --metrics-export-port="$METRICS_EXPORT_PORT" --runtime-env-agent-port="$RUNTIME_ENV_AGENT_PORT"
  --min-worker-port="$MIN_WORKER_PORT" --max-worker-port="$MAX_WORKER_PORT" --disable-usage-stats)
if [[ $role == head ]]; then
  args=(--head --port="$GCS_PORT" --ray-client-server-port="$RAY_CLIENT_SERVER_PORT" "${args[@]}")
  if ((dashboard)); then
    args+=(--include-dashboard=true --dashboard-host=0.0.0.0 --dashboard-port="$DASHBOARD_PORT")
  else
    args+=(--include-dashboard=false)
  fi
else
  args=(--address="$address" "${args[@]}")
fi
[[ -n $ip ]] && args+=(--node-ip-address="$ip")
[[ -n $resources ]] && args+=(--resources="$resources")
[[ -n $cpus ]] && args+=(--num-cpus="$cpus")
[[ -n $gpus ]] && args+=(--num-gpus="$gpus")
[[ -n $temp_dir ]] && args+=(--temp-dir="$temp_dir")
args+=("${extra[@]}")

if [[ $role == head ]]; then
  head=${ip:-$(hostname -I 2>/dev/null | awk '{print $1}')}
  echo "ray_up.sh: on each other host: ray_up.sh worker --address ${head:-HEAD_IP}:$GCS_PORT" \
    "(with this token)"
  echo "ray_up.sh: the job: python train_async.py --ray-address ${head:-HEAD_IP}:$GCS_PORT ..." \
    "(RAY_AUTH_MODE=token and the token in its environment)"
fi
if ((block)); then
  exec ray start --block "${args[@]}"
fi
ray start "${args[@]}"
