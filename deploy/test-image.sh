#!/usr/bin/env bash
# Builds the CPU-only flashserve image with podman (no Docker engine, no registry needed), runs it, checks it
# end to end, and validates the Compose file and the Kubernetes manifests. Exit 0 when everything passed.
#
#   deploy/test-image.sh            (root; installs podman, runc, debootstrap with apt when missing)
#
# Stages (each prints its duration):
#   1. tools        podman/runc/debootstrap present
#   2. base         localhost/debian:bookworm and :bookworm-slim from one debootstrap (cached: skipped when
#                   both images exist; FORCE_BASE=1 rebuilds them)
#   3. build        podman build --isolation chroot of deploy/Dockerfile, CPU variant (layer cache kept)
#   4. inspect      non-root user, exec-form entrypoint, ports, volume, healthcheck, size
#   5. run          container on free non-default ports with --network host; waits for /v2/health/ready
#   6. probe        image HEALTHCHECK command, `python -m flashserve check`, /metrics scrape
#   7. stop         SIGTERM (podman stop -t 10): exits 0 within 10 s, no error lines in its log
#   8. compose      docker-compose.yml (+ the CPU override) against the Compose spec
#   9. kubernetes   deploy/kubernetes/*.yaml against the Kubernetes schemas + flashserve-specific checks
#  10. cuda         only with CHECK_CUDA=1: the CUDA variant's build path (FLASHSERVE_ENABLE_CUDA=ON, static
#                   cudart, bundle without libcuda) on the local Debian base with this machine's CUDA toolkit
#                   bind-mounted (nvidia/cuda images cannot be pulled here), then a start without a GPU
#                   (falls back to the CPU backend) and a SIGTERM stop. Small kernel set (sm_80, fp16, d64)
#                   unless CUDA_CMAKE_ARGS says otherwise.
#
# Environment: IMAGE (default localhost/flashserve:cpu-test), KEEP=1 keeps the container after a failure,
# SKIP_BUILD=1 reuses IMAGE as it is, FORCE_BASE=1 re-debootstraps the base images, BUILD_ONLY=1 stops after
# stage 3 (.ci/run builds the image ahead this way; its later full run finds every layer cached), CHECK_CUDA=1 adds
# stage 10 (CUDA_ARCHS, default 80, and CUDA_CMAKE_ARGS tune its kernel set).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

IMAGE=${IMAGE:-localhost/flashserve:cpu-test}
BASE=localhost/debian:bookworm
BASE_SLIM=localhost/debian:bookworm-slim
NAME=flashserve-test-$$
TOOLS=$ROOT/build-deploy-tools            # git-ignored (/build*/): venv with the validators
PODMAN=(podman --runtime runc --cgroup-manager cgroupfs)
RUN_FLAGS=(--network host --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
# podman schedules HEALTHCHECKs with systemd timers, which this machine lacks (it logs "unable to get systemd
# connection"; harmless): the container runs with --health-interval=disable and the probe stage triggers the
# image's HEALTHCHECK once with `podman healthcheck run`.

T_START=$(date +%s.%N)
STAGE_NAME=""; STAGE_T0=0
SUMMARY=()
stage() {
  stage_end
  STAGE_NAME=$1; STAGE_T0=$(date +%s.%N)
  echo; echo "=== [$STAGE_NAME] $2"
}
stage_end() {
  if [[ -n $STAGE_NAME ]]; then
    local dt; dt=$(awk -v a="$STAGE_T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
    echo "--- [$STAGE_NAME] done in ${dt}s"
    SUMMARY+=("$(printf '%-11s %7ss' "$STAGE_NAME" "$dt")")
    STAGE_NAME=""
  fi
}
fail() { echo "FAIL [$STAGE_NAME]: $*" >&2; exit 1; }
ok() { echo "ok   $*"; }

cleanup() {
  local rc=$?
  if "${PODMAN[@]}" container exists "$NAME" 2>/dev/null; then
    if ((rc != 0)); then echo "--- container log ($NAME):"; "${PODMAN[@]}" logs "$NAME" 2>&1 | tail -n 40 || true; fi
    if [[ ${KEEP:-0} == 1 && $rc != 0 ]]; then
      echo "KEEP=1: container $NAME left in place"
    else
      "${PODMAN[@]}" rm -f -t 0 "$NAME" >/dev/null 2>&1 || true
    fi
  fi
  if ((rc != 0)); then echo "test-image.sh: FAILED (rc=$rc) in stage ${STAGE_NAME:-?}" >&2; fi
}
trap cleanup EXIT

apt_install() {
  echo "installing with apt: $*"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# ------------------------------------------------------------------------------------------------
stage tools "podman, runc, debootstrap"
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v curl >/dev/null || missing+=(curl)
((${#missing[@]} == 0)) || apt_install "${missing[@]}"
ok "$(podman --version), $(runc --version | head -n 1)"

# ------------------------------------------------------------------------------------------------
stage base "local base images $BASE and $BASE_SLIM (no registry here)"
if [[ ${FORCE_BASE:-0} != 1 ]] && podman image exists "$BASE" && podman image exists "$BASE_SLIM"; then
  ok "cached: $BASE, $BASE_SLIM"
else
  ROOTFS=$(mktemp -d /tmp/flashserve-rootfs.XXXXXX)
  debootstrap --variant=minbase bookworm "$ROOTFS" http://deb.debian.org/debian >"$ROOTFS.log" 2>&1 \
    || { tail -n 20 "$ROOTFS.log"; fail "debootstrap failed"; }
  # Like the official images: no downloaded .debs, no package lists (RUN steps run apt-get update).
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/*.log
  tar -C "$ROOTFS" -c . | podman import --quiet - "$BASE" >/dev/null
  # bookworm-slim: the official slim's dpkg excludes (docs, man pages, locales) applied to the same tree.
  cat > "$ROOTFS/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
EOF
  find "$ROOTFS/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
  rm -rf "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/usr/share/locale/* "$ROOTFS"/usr/share/groff/*
  tar -C "$ROOTFS" -c . | podman import --quiet - "$BASE_SLIM" >/dev/null
  rm -rf "$ROOTFS" "$ROOTFS.log"
  ok "imported $BASE, $BASE_SLIM"
fi
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "debian:bookworm" | sed 's/^/     /'

# ------------------------------------------------------------------------------------------------
stage build "podman build deploy/Dockerfile (CPU variant) -> $IMAGE"
if [[ ${SKIP_BUILD:-0} == 1 ]] && podman image exists "$IMAGE"; then
  ok "SKIP_BUILD=1: using $IMAGE as it is"
else
  # --format docker keeps HEALTHCHECK/STOPSIGNAL (the OCI format drops HEALTHCHECK).
  set +e
  podman build --isolation chroot --format docker --layers \
    -f deploy/Dockerfile \
    --build-arg BUILDER_IMAGE="$BASE" \
    --build-arg RUNTIME_IMAGE="$BASE_SLIM" \
    --build-arg FLASHSERVE_ENABLE_CUDA=OFF \
    -t "$IMAGE" . 2>&1 | tee /tmp/flashserve-test-image-build.log | grep -E '^(\[[0-9]/[0-9]\] )?STEP|^(COMMIT|bundle:|ok |FAIL|Error|error)'
  build_rc=${PIPESTATUS[0]}
  set -e
  ((build_rc == 0)) || { tail -n 30 /tmp/flashserve-test-image-build.log; fail "podman build failed (rc=$build_rc)"; }
fi
if [[ ${BUILD_ONLY:-0} == 1 ]]; then
  stage_end
  echo "test-image.sh: $IMAGE built; BUILD_ONLY=1: not inspected, not run"
  exit 0
fi

# ------------------------------------------------------------------------------------------------
stage inspect "image metadata and size"
inspect_json=$(podman image inspect "$IMAGE")
python3 - "$inspect_json" <<'EOF' || fail "image metadata"
import json, sys
img = json.loads(sys.argv[1])[0]
c = img["Config"]
c.setdefault("Healthcheck", img.get("Healthcheck"))   # podman keeps it beside Config
errors = []
user = c.get("User", "")
if not user or user.split(":")[0] in ("", "0", "root"):
    errors.append(f"runs as root (User={user!r})")
ep = c.get("Entrypoint") or []
if not ep or ep[0] in ("/bin/sh", "sh", "bash", "/bin/bash") or not ep[0].endswith("/flashserve"):
    errors.append(f"ENTRYPOINT is not the exec-form server: {ep}")
if "--host=0.0.0.0" not in ep + (c.get("Cmd") or []):
    errors.append("server does not listen on 0.0.0.0")
ports = set((c.get("ExposedPorts") or {}).keys())
for p in ("8000/tcp", "8001/tcp", "8002/tcp"):
    if p not in ports: errors.append(f"EXPOSE {p} missing")
if "/var/cache/flashserve" not in (c.get("Volumes") or {}):
    errors.append("VOLUME /var/cache/flashserve missing")
hc = (c.get("Healthcheck") or {}).get("Test") or []
if not hc or "/v2/health/ready" not in " ".join(hc):
    errors.append(f"HEALTHCHECK on /v2/health/ready missing: {hc}")
if c.get("StopSignal") not in (None, "", "SIGTERM", "15"):
    errors.append(f"StopSignal {c.get('StopSignal')}")
print(f"ok   user={user} entrypoint={ep} cmd={c.get('Cmd')} ports={sorted(ports)} volumes={list((c.get('Volumes') or {}))}")
print(f"ok   healthcheck={hc[0] if hc else None} ... interval={(c.get('Healthcheck') or {}).get('Interval', 0)/1e9:.0f}s")
if errors:
    print("\n".join("FAIL " + e for e in errors)); sys.exit(1)
EOF
img_size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
base_size=$(podman image inspect --format '{{.Size}}' "$BASE_SLIM")
ok "image size $((img_size / 1000000)) MB (base $BASE_SLIM $((base_size / 1000000)) MB, flashserve layers +$(((img_size - base_size) / 1000000)) MB)"
hist=$(podman history --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE")
echo "layers with content (newest first):"
awk -F'\t' '$1 != "0 B" {printf "     %-9s %s\n", $1, substr($2, 1, 95)}' <<<"$hist"

# ------------------------------------------------------------------------------------------------
stage run "start the container on free ports (--network host)"
read -r GRPC_PORT HTTP_PORT METRICS_PORT < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
EOF
)
SERVER_FLAGS=(--grpc_port="$GRPC_PORT" --http_port="$HTTP_PORT" --backend=cpu)
# --metrics_port is new: pass it when this build of the server knows it.
HAVE_METRICS=0
help_text=$("${PODMAN[@]}" run --rm "${RUN_FLAGS[@]}" --health-interval=disable "$IMAGE" --helpfull 2>&1 || true)   # absl: --help exits 1
if grep -q -- '--metrics_port' <<<"$help_text"; then
  HAVE_METRICS=1; SERVER_FLAGS+=(--metrics_port="$METRICS_PORT")
fi
"${PODMAN[@]}" run -d --name "$NAME" "${RUN_FLAGS[@]}" -e FLASHSERVE_HTTP_PORT="$HTTP_PORT" \
  --health-interval=disable "$IMAGE" "${SERVER_FLAGS[@]}" >/dev/null 2>/tmp/flashserve-test-run.err \
  || { cat /tmp/flashserve-test-run.err; fail "podman run failed"; }
ok "container $NAME: grpc=$GRPC_PORT http=$HTTP_PORT$( ((HAVE_METRICS)) && echo " metrics=$METRICS_PORT" || echo " (no --metrics_port in this build)")"
t0=$(date +%s.%N); ready=0
for _ in $(seq 1 150); do
  if curl -fsS -o /dev/null "http://127.0.0.1:$HTTP_PORT/v2/health/ready" 2>/dev/null; then ready=1; break; fi
  [[ $("${PODMAN[@]}" inspect --format '{{.State.Running}}' "$NAME") == true ]] || fail "container exited before ready"
  sleep 0.2
done
((ready)) || fail "not ready after 30 s"
ok "ready after $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b-a}')s; live: $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$HTTP_PORT/v2/health/live")"
pid1=$("${PODMAN[@]}" top "$NAME" pid user comm 2>/dev/null | awk 'NR==2{print $1, $2, $3}' || true)
ok "PID 1 in the container: ${pid1:-?} (expect: 1 <uid 10001> flashserve)"
[[ -z $pid1 || $pid1 == "1 "*" flashserve" ]] || fail "PID 1 is not the server: $pid1"

# ------------------------------------------------------------------------------------------------
stage probe "image HEALTHCHECK, python client check, /metrics"
# The image's own HEALTHCHECK (bash /dev/tcp GET /v2/health/ready), run once by podman.
if "${PODMAN[@]}" healthcheck run "$NAME" 2>/dev/null; then
  ok "HEALTHCHECK: $("${PODMAN[@]}" inspect --format '{{.State.Health.Status}}' "$NAME" 2>/dev/null)"
else
  fail "HEALTHCHECK reported unhealthy"
fi

VENV_PY=$ROOT/.venv/bin/python
if [[ -x $VENV_PY ]] && "$VENV_PY" -m flashserve --help >/dev/null 2>&1; then
  t0=$(date +%s.%N)
  "$VENV_PY" -m flashserve check --address "127.0.0.1:$GRPC_PORT" 2>&1 | tail -n 15 | sed 's/^/     /'
  [[ ${PIPESTATUS[0]} == 0 ]] || fail "python -m flashserve check failed"
  ok "flashserve check passed in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s"
else
  echo "SKIP python -m flashserve check: the client is not installed in .venv (run scripts/setup)"
fi

if ((HAVE_METRICS)); then
  metrics=$(curl -fsS "http://127.0.0.1:$METRICS_PORT/metrics") || fail "GET /metrics failed"
  py=python3; [[ -x $VENV_PY ]] && "$VENV_PY" -c 'import prometheus_client' 2>/dev/null && py=$VENV_PY
  echo "$metrics" | "$py" -c '
import sys
text = sys.stdin.read()
try:
    from prometheus_client.parser import text_string_to_metric_families
    fams = [f.name for f in text_string_to_metric_families(text)]
    how = "parsed by prometheus_client"
except ImportError:
    fams = sorted({l.split("{")[0].split(" ")[0] for l in text.splitlines() if l and not l.startswith("#")})
    how = "(prometheus_client not installed: line check only)"
fs = [f for f in fams if f.startswith("flashserve_")]
if not fs: sys.exit("no flashserve_ metrics")
names = ", ".join(fs[:6]) + (" ..." if len(fs) > 6 else "")
print(f"ok   /metrics: {len(fs)} flashserve_ families {how}: {names}")
' || fail "/metrics content"
  reqs=$(echo "$metrics" | grep -E '^flashserve_requests_total' | head -n 3 || true)
  [[ -n $reqs ]] && echo "$reqs" | sed 's/^/     /'
else
  echo "SKIP /metrics: this build of the server has no --metrics_port flag yet"
fi

# ------------------------------------------------------------------------------------------------
stage stop "SIGTERM -> drain -> exit 0 within 10 s"
t0=$(date +%s.%N)
"${PODMAN[@]}" stop -t 10 "$NAME" >/dev/null 2>>/tmp/flashserve-test-run.err
dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b-a}')
code=$("${PODMAN[@]}" inspect --format '{{.State.ExitCode}}' "$NAME")
logs=$("${PODMAN[@]}" logs "$NAME" 2>&1)
echo "$logs" | tail -n 4 | sed 's/^/     /'
awk -v d="$dt" 'BEGIN{exit !(d < 10)}' || fail "stop took ${dt}s (SIGKILL after 10 s?)"
[[ $code == 0 ]] || fail "exit code $code after SIGTERM"
if echo "$logs" | grep -Eiq '\[(error|critical)\]|"level": ?"(error|critical)"|terminate called|Segmentation|Aborted|sanitizer'; then
  echo "$logs" | grep -Ei 'error|critical|terminate|Segmentation|Aborted|sanitizer' | head -n 5
  fail "error lines in the server log"
fi
ok "stopped in ${dt}s, exit code $code, no error lines in $(echo "$logs" | wc -l) log lines"
"${PODMAN[@]}" rm "$NAME" >/dev/null 2>>/tmp/flashserve-test-run.err

# ------------------------------------------------------------------------------------------------
# Validator tools live in a venv under build-deploy-tools/ (git-ignored), installed from PyPI once.
tools_venv() {
  if [[ ! -x $TOOLS/venv/bin/python ]] || ! "$TOOLS/venv/bin/python" -c 'import jsonschema, yaml, kubernetes_validate' 2>/dev/null; then
    echo "installing validators into $TOOLS/venv (pip: jsonschema, pyyaml, kubernetes-validate)"
    python3 -m venv "$TOOLS/venv"
    "$TOOLS/venv/bin/pip" install -q jsonschema pyyaml kubernetes-validate
  fi
  # The Compose specification's JSON schema, as shipped inside the docker-compose 1.29.2 package (PyPI).
  if [[ ! -f $TOOLS/compose_spec.json ]]; then
    "$TOOLS/venv/bin/pip" download -q --no-deps docker-compose==1.29.2 -d "$TOOLS/dl"
    "$TOOLS/venv/bin/python" -c 'import sys, zipfile, glob
z = zipfile.ZipFile(glob.glob(sys.argv[1] + "/docker_compose-*.whl")[0])
open(sys.argv[2], "wb").write(z.read("compose/config/compose_spec.json"))' "$TOOLS/dl" "$TOOLS/compose_spec.json"
  fi
}

stage compose "deploy/docker-compose.yml (+ docker-compose.cpu.yml)"
tools_venv
if docker compose version >/dev/null 2>&1; then
  docker compose -f deploy/docker-compose.yml config -q && ok "docker compose config (GPU stack)"
  docker compose -f deploy/docker-compose.yml -f deploy/docker-compose.cpu.yml config -q && ok "docker compose config (CPU stack)"
else
  echo "note docker compose plugin not available (no registry for it here): checking against the Compose spec schema"
fi
"$TOOLS/venv/bin/python" - "$TOOLS/compose_spec.json" deploy/docker-compose.yml deploy/docker-compose.cpu.yml <<'EOF' || fail "compose validation"
import copy, json, os, sys, yaml, jsonschema
schema = json.load(open(sys.argv[1]))
schema.get("properties", {}).setdefault("name", {"type": "string"})   # top-level name: newer than this schema copy
base_path, cpu_path = sys.argv[2], sys.argv[3]
deploy_dir = os.path.dirname(base_path)
errors = []
def check_schema(path):
    doc = yaml.safe_load(open(path))
    v = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)
    errs = sorted(v.iter_errors(doc), key=lambda e: list(e.path))
    for e in errs:
        errors.append(f"{path}: {'/'.join(map(str, e.path))}: {e.message}")
    return doc
base = check_schema(base_path)
cpu = check_schema(cpu_path)
print(f"ok   {base_path} and {cpu_path} match the Compose spec schema")

def merge(a, b):  # the subset of Compose merge rules these files use
    out = copy.deepcopy(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict): out[k] = merge(out[k], v)
        else: out[k] = copy.deepcopy(v)
    return out

s = base["services"]
fs = s.get("flashserve") or {}
dev = (((fs.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
if not any(d.get("driver") == "nvidia" and d.get("count") == 1 and "gpu" in d.get("capabilities", []) for d in dev):
    errors.append("flashserve: no GPU reservation (driver nvidia, count 1, capabilities [gpu])")
if fs.get("build", {}).get("dockerfile") != "deploy/Dockerfile": errors.append("flashserve: build.dockerfile")
if not os.path.isfile(os.path.join(deploy_dir, fs["build"]["context"], fs["build"]["dockerfile"])):
    errors.append("flashserve: build context + dockerfile do not point at deploy/Dockerfile")
for svc in ("prometheus", "grafana"):
    if svc not in s: errors.append(f"service {svc} missing")
if "profiles" in fs: errors.append("flashserve must start by default (no profile) in the base file")
# bind-mounted config: flag what does not exist (yet)
for name, svc in s.items():
    for vol in svc.get("volumes", []):
        src = vol.split(":")[0]
        if src.startswith("."):
            p = os.path.normpath(os.path.join(deploy_dir, src))
            print(f"{'ok  ' if os.path.exists(p) else 'WARN'} {name}: mount source {p} {'exists' if os.path.exists(p) else 'does not exist yet'}")
prom = os.path.join(deploy_dir, "prometheus/prometheus.yml")
if os.path.exists(prom):
    text = open(prom).read()
    print(f"{'ok  ' if 'flashserve:8002' in text else 'WARN'} prometheus.yml {'scrapes' if 'flashserve:8002' in text else 'does not mention'} flashserve:8002")
# the CPU stack: flashserve parked behind a profile, flashserve-cpu answers as "flashserve", no GPU asked
merged = merge(base, cpu)
active = {n: v for n, v in merged["services"].items() if not v.get("profiles")}
if "flashserve" in active: errors.append("CPU stack: the GPU flashserve service still starts")
fc = active.get("flashserve-cpu", {})
if "flashserve" not in (((fc.get("networks") or {}).get("default") or {}).get("aliases") or []):
    errors.append("CPU stack: flashserve-cpu lacks the network alias 'flashserve'")
if fc.get("build", {}).get("args", {}).get("FLASHSERVE_ENABLE_CUDA") != "OFF": errors.append("CPU stack: CUDA not OFF")
if any("deploy" in v for v in active.values()): errors.append("CPU stack: a started service reserves devices")
for n, v in active.items():
    for d in v.get("depends_on", []) if isinstance(v.get("depends_on"), list) else (v.get("depends_on") or {}):
        if d not in active: errors.append(f"CPU stack: {n} depends on {d}, which does not start")
print(f"ok   CPU stack starts: {sorted(active)}")
if errors:
    print("\n".join("FAIL " + e for e in errors)); sys.exit(1)
EOF

# ------------------------------------------------------------------------------------------------
stage kubernetes "deploy/kubernetes manifests"
"$TOOLS/venv/bin/python" - deploy/kubernetes <<'EOF' || fail "kubernetes validation"
import glob, os, sys, yaml
import kubernetes_validate
d = sys.argv[1]
files = sorted(glob.glob(os.path.join(d, "*.yaml")))
docs = []
for f in files:
    for doc in yaml.safe_load_all(open(f)):
        if doc: docs.append((f, doc))
errors = []
K8S_VERSION = "1.30"
for f, doc in docs:
    kind = doc.get("kind")
    if kind == "Kustomization":
        for r in doc.get("resources", []):
            if not os.path.exists(os.path.join(d, r)): errors.append(f"kustomization: {r} missing")
        continue
    for field in ("apiVersion", "kind", "metadata"):
        if field not in doc: errors.append(f"{f}: {kind}: {field} missing")
    if doc.get("apiVersion", "").startswith("monitoring.coreos.com/"):
        continue   # CRD: checked by hand below
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        print(f"ok   {os.path.basename(f)}: {kind}/{doc['metadata']['name']} valid against the Kubernetes {K8S_VERSION} schema (strict)")
    except kubernetes_validate.ValidationError as e:
        errors.append(f"{f}: {kind}/{doc.get('metadata', {}).get('name')}: {e.message} at {'/'.join(map(str, e.path))}")
    except Exception as e:
        errors.append(f"{f}: {kind}: {type(e).__name__}: {e}")

by_kind = {}
for f, doc in docs: by_kind.setdefault(doc.get("kind"), []).append(doc)
dep = (by_kind.get("Deployment") or [None])[0]
if not dep:
    errors.append("no Deployment")
else:
    spec = dep["spec"]; pod = spec["template"]["spec"]; labels = spec["template"]["metadata"].get("labels", {})
    c = pod["containers"][0]
    if any(labels.get(k) != v for k, v in spec["selector"]["matchLabels"].items()): errors.append("selector does not match pod labels")
    lim = c.get("resources", {}).get("limits", {})
    if str(lim.get("nvidia.com/gpu")) != "1": errors.append("limits nvidia.com/gpu != 1")
    if not c.get("resources", {}).get("requests"): errors.append("no resource requests")
    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
    if ports != {"http": 8000, "grpc": 8001, "metrics": 8002}: errors.append(f"container ports {ports}")
    for probe, path in (("livenessProbe", "/v2/health/live"), ("readinessProbe", "/v2/health/ready")):
        g = (c.get(probe) or {}).get("httpGet") or {}
        if g.get("path") != path or g.get("port") not in ("http", 8000): errors.append(f"{probe} is not GET {path} on http")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    server_grace = 10
    for a in c.get("args", []):
        if a.startswith("--shutdown_grace_seconds="): server_grace = int(a.split("=")[1])
    prestop = 0
    ps = ((c.get("lifecycle") or {}).get("preStop") or {})
    if "sleep" in ps: prestop = int(ps["sleep"]["seconds"])
    elif "exec" in ps and ps["exec"]["command"][:1] in (["sleep"], ["/bin/sleep"]): prestop = int(ps["exec"]["command"][1])
    if grace <= server_grace + prestop: errors.append(f"terminationGracePeriodSeconds {grace} <= preStop {prestop} + server grace {server_grace}")
    psc, csc = pod.get("securityContext", {}), c.get("securityContext", {})
    if not (psc.get("runAsNonRoot") or csc.get("runAsNonRoot")): errors.append("runAsNonRoot not set")
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    if uid in (None, 0): errors.append("runAsUser missing or 0")
    if csc.get("allowPrivilegeEscalation") is not False: errors.append("allowPrivilegeEscalation not false")
    ann = spec["template"]["metadata"].get("annotations", {})
    if ann.get("prometheus.io/scrape") != "true" or ann.get("prometheus.io/port") != "8002": errors.append("prometheus.io annotations")
    print(f"ok   Deployment: gpu limit 1, probes live/ready, grace {grace}s > preStop {prestop}s + {server_grace}s, uid {uid}, non-root")
svcs = by_kind.get("Service", [])
main = [s for s in svcs if s["spec"].get("clusterIP") != "None"]
headless = [s for s in svcs if s["spec"].get("clusterIP") == "None"]
if not main: errors.append("no ClusterIP Service")
else:
    sp = {p["name"]: (p["port"], p.get("targetPort")) for p in main[0]["spec"]["ports"]}
    for n, port in (("http", 8000), ("grpc", 8001), ("metrics", 8002)):
        if n not in sp or sp[n][0] != port: errors.append(f"Service port {n} != {port}")
    if dep and any(dep["spec"]["template"]["metadata"]["labels"].get(k) != v for k, v in main[0]["spec"]["selector"].items()):
        errors.append("Service selector does not match the pods")
    grpc_app = [p for p in main[0]["spec"]["ports"] if p["name"] == "grpc"][0].get("appProtocol")
    print(f"ok   Service {main[0]['metadata']['name']}: ports {sp}, grpc appProtocol={grpc_app}")
if not headless: errors.append("no headless Service for client-side gRPC load balancing")
else: print(f"ok   headless Service {headless[0]['metadata']['name']} (dns:/// + round_robin)")
pm = (by_kind.get("PodMonitor") or [None])[0]
if not pm: errors.append("no PodMonitor")
else:
    if pm.get("apiVersion") != "monitoring.coreos.com/v1": errors.append("PodMonitor apiVersion")
    eps = pm["spec"].get("podMetricsEndpoints") or []
    if not eps or eps[0].get("port") != "metrics" or eps[0].get("path", "/metrics") != "/metrics": errors.append("PodMonitor endpoint")
    sel = pm["spec"].get("selector", {}).get("matchLabels", {})
    if not sel or (dep and any(dep["spec"]["template"]["metadata"]["labels"].get(k) != v for k, v in sel.items())):
        errors.append("PodMonitor selector does not match the pods")
    print(f"ok   PodMonitor {pm['metadata']['name']}: port metrics {eps[0].get('path', '/metrics')} every {eps[0].get('interval', 'default')}")
pr = (by_kind.get("PrometheusRule") or [None])[0]
alerts = yaml.safe_load(open(os.path.join(d, "..", "prometheus", "alerts.yml")))
if not pr: errors.append("no PrometheusRule")
elif pr.get("apiVersion") != "monitoring.coreos.com/v1": errors.append("PrometheusRule apiVersion")
elif pr["spec"].get("groups") != alerts["groups"]: errors.append("PrometheusRule groups differ from deploy/prometheus/alerts.yml")
else: print(f"ok   PrometheusRule {pr['metadata']['name']}: the {sum(len(g['rules']) for g in alerts['groups'])} rules of alerts.yml")
print(f"ok   {len(docs)} documents in {len(files)} files")
if errors:
    print("\n".join("FAIL " + e for e in errors)); sys.exit(1)
EOF

# ------------------------------------------------------------------------------------------------
if [[ ${CHECK_CUDA:-0} == 1 ]]; then
  stage cuda "CUDA variant of deploy/Dockerfile with the host CUDA toolkit (no GPU here)"
  CUDA_HOME_REAL=$(readlink -f /usr/local/cuda)
  [[ -x $CUDA_HOME_REAL/bin/nvcc ]] || fail "no CUDA toolkit at /usr/local/cuda"
  # Debian 12's stock CMake 3.25.1 FindCUDAToolkit fails on CUDA 13 (no libnvToolsExt any more:
  # "set_property could not find TARGET CUDA::nvToolsExt"; fixed in later CMake, e.g. Ubuntu 24.04's 3.28
  # in the real nvidia/cuda builder). Pointing CUDA_nvToolsExt_LIBRARY at any existing file avoids it.
  CUDA_CMAKE_ARGS=${CUDA_CMAKE_ARGS:--DFLASHSERVE_KERNEL_DTYPES=fp16 -DFLASHSERVE_KERNEL_HEAD_DIMS=64}
  podman build --isolation chroot --format docker --layers -f deploy/Dockerfile \
    --volume "$CUDA_HOME_REAL:/usr/local/cuda:ro" \
    --build-arg BUILDER_IMAGE="$BASE" --build-arg RUNTIME_IMAGE="$BASE_SLIM" \
    --build-arg FLASHSERVE_ENABLE_CUDA=ON --build-arg FLASHSERVE_CUDA_ARCHS="${CUDA_ARCHS:-80}" \
    --build-arg CMAKE_EXTRA_ARGS="$CUDA_CMAKE_ARGS -DCUDA_nvToolsExt_LIBRARY=/usr/local/cuda/lib64/libcudart_static.a" \
    -t "$IMAGE-cuda" . > /tmp/flashserve-test-image-cuda.log 2>&1 \
    || { grep -E "error|Error" /tmp/flashserve-test-image-cuda.log | head -n 20; fail "CUDA variant build failed"; }
  grep -E "^-- flashserve|^bundle:|^ok " /tmp/flashserve-test-image-cuda.log | sed 's/^/     /'
  grep -q "CUDA=ON" /tmp/flashserve-test-image-cuda.log || fail "CMake did not enable CUDA"
  libs=$("${PODMAN[@]}" run --rm "${RUN_FLAGS[@]}" --health-interval=disable --entrypoint ls "$IMAGE-cuda" /opt/flashserve/lib 2>>/tmp/flashserve-test-run.err)
  if grep -E '^lib(cuda|cudart|nvidia)' <<<"$libs"; then fail "driver/CUDA runtime libraries in the bundle"; fi
  ok "no libcuda/libcudart/libnvidia-* in lib/ ($(wc -l <<<"$libs") libraries; cudart is static)"
  read -r CG CH CM < <(python3 -c 'import socket; s=[socket.socket() for _ in range(3)]; [x.bind(("127.0.0.1",0)) for x in s]; print(*[x.getsockname()[1] for x in s])')
  "${PODMAN[@]}" run -d --name "$NAME" "${RUN_FLAGS[@]}" --health-interval=disable "$IMAGE-cuda" \
    --grpc_port="$CG" --http_port="$CH" --metrics_port="$CM" >/dev/null 2>>/tmp/flashserve-test-run.err
  for _ in $(seq 1 150); do curl -fsS -o /dev/null "http://127.0.0.1:$CH/v2/health/ready" 2>/dev/null && break; sleep 0.2; done
  curl -fsS -o /dev/null "http://127.0.0.1:$CH/v2/health/ready" || fail "CUDA image not ready"
  "${PODMAN[@]}" stop -t 10 "$NAME" >/dev/null 2>>/tmp/flashserve-test-run.err
  code=$("${PODMAN[@]}" inspect --format '{{.State.ExitCode}}' "$NAME")
  "${PODMAN[@]}" logs "$NAME" 2>&1 | head -n 1 | cut -c1-200 | sed 's/^/     /'
  "${PODMAN[@]}" rm "$NAME" >/dev/null 2>>/tmp/flashserve-test-run.err
  [[ $code == 0 ]] || fail "CUDA image exit code $code"
  ok "CUDA image $IMAGE-cuda ($(( $(podman image inspect --format '{{.Size}}' "$IMAGE-cuda") / 1000000 )) MB on $BASE_SLIM): ready without a GPU (CPU fallback), SIGTERM exit 0"
fi

stage_end
echo
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
printf 'total       %7ss\n' "$(awk -v a="$T_START" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')"
echo "test-image.sh: PASSED"
