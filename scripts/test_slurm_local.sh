#!/usr/bin/env bash
# Run the Slurm paths for real on a single-node Slurm on this machine (root, Debian/Ubuntu, no systemd):
#
#   1. installs slurm-wlm (slurmctld + slurmd) and munge, writes /etc/slurm/slurm.conf for one node
#      (this host, all its CPUs, no GPUs, no cgroups), starts munged, slurmctld and slurmd as daemons
#      and waits until the node is idle;
#   2. submits launchers/slurm/ray_cluster.sbatch with the quick experiment and checks the job's exit
#      code, metrics.jsonl (2 steps) and summary.json (completed);
#   3. submits it again with --requeue, requeues the job once it wrote a checkpoint (a newer decoy
#      checkpoint of the same experiment planted beside it) and checks the second attempt resumed
#      the job's own run (resume=run_dir) and completed it;
#   4. runs a 2-job sweep through `hydra/launcher=submitit_slurm` and checks both Slurm jobs and the
#      sweep's summary.csv (two completed rows).
#
#   sudo bash scripts/test_slurm_local.sh            # all of it
#   PARTS=setup bash scripts/test_slurm_local.sh     # only the Slurm installation (also: sbatch, requeue, sweep)
#
# Idempotent: installed packages, an unchanged slurm.conf and running daemons are left as they are
# (a changed slurm.conf restarts slurmctld and slurmd). Exits non-zero on the first failing part.
# Knobs: RLHF_ORCH_PYTHON (default <repo>/.venv/bin/python), RAY_NUM_CPUS (logical CPUs of the
# template's Ray head, default max(nproc, 16): the quick plan's bundles need more than 2 cores),
# WORK_DIR (run dirs and Slurm output, default a new /tmp/rlhf_orch_slurm.XXXX), JOB_TIMEOUT_S
# (per part, default 1500).
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${RLHF_ORCH_PYTHON:-$REPO/.venv/bin/python}
PARTS=${PARTS:-setup sbatch requeue sweep}
NCPUS=$(nproc)
RAY_NUM_CPUS=${RAY_NUM_CPUS:-$((NCPUS > 16 ? NCPUS : 16))}
JOB_TIMEOUT_S=${JOB_TIMEOUT_S:-1500}
HOST=$(hostname -s)
PARTITION=debug
SLURM_CONF=/etc/slurm/slurm.conf

PASSED=()
log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
pass() { PASSED+=("$1"); log "PASS: $1"; }
fail() {
    log "FAIL: $*"
    summary
    exit 1
}
summary() {
    echo "---- passed (${#PASSED[@]}):"
    for p in "${PASSED[@]}"; do echo "  ok  $p"; done
}
want() { [[ " $PARTS " == *" $1 "* ]]; }

[[ $(id -u) -eq 0 ]] || fail "run as root (installs packages, writes /etc/slurm, starts daemons)"
[[ -x $PYTHON ]] || fail "no interpreter at $PYTHON (set RLHF_ORCH_PYTHON)"
if [[ -z ${WORK_DIR:-} ]]; then
    WORK_DIR=$(mktemp -d /tmp/rlhf_orch_slurm.XXXXXX)
fi
mkdir -p "$WORK_DIR"
chmod 755 "$WORK_DIR"
log "repo $REPO, python $PYTHON, work dir $WORK_DIR, node $HOST ($NCPUS CPUs), parts: $PARTS"

# ---------------------------------------------------------------------------------------------------
# Slurm: packages, munge, slurm.conf, daemons
# ---------------------------------------------------------------------------------------------------
pid_alive() {  # pid_alive <pidfile> <command name>
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ -n $pid && -d /proc/$pid ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]]
}

stop_daemon() {  # stop_daemon <pidfile> <command name>: only the daemon its pidfile names
    local pid
    pid_alive "$1" "$2" || return 0
    pid=$(cat "$1")
    log "stopping $2 (pid $pid)"
    kill "$pid"
    for _ in $(seq 1 30); do
        [[ -d /proc/$pid ]] || return 0
        sleep 1
    done
    kill -9 "$pid" 2>/dev/null || true
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        log "slurm-wlm and munge already installed ($(slurmd -V))"
        return
    fi
    log "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    # policy-rc.d (containers) stops the packages' init scripts from starting daemons: we start them.
    apt-get update -qq && apt-get install -y -qq --no-install-recommends \
        slurm-wlm slurmctld slurmd slurm-client munge >/dev/null \
        || fail "apt-get install slurm-wlm munge"
}

start_munge() {
    install -d -o munge -g munge -m 0700 /etc/munge
    install -d -o munge -g munge -m 0711 /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key || fail "mungekey --create"
    fi
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        log "munged is running"
        return
    fi
    log "starting munged"
    runuser -u munge -- munged --force || fail "munged did not start (see /var/log/munge/munged.log)"
    for _ in $(seq 1 10); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 1
    done
    fail "munge -n | unmunge does not work (see /var/log/munge/munged.log)"
}

write_slurm_conf() {  # sets CONF_CHANGED=1 when /etc/slurm/slurm.conf was (re)written
    local mem_mb real_mb new
    mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    real_mb=$((mem_mb * 95 / 100))  # a bit below the machine's: slurmd drains a node that has less
    new=$(mktemp)
    cat >"$new" <<EOF
# Written by rlhf_orch scripts/test_slurm_local.sh: a single-node Slurm on this machine.
ClusterName=rlhforch
SlurmctldHost=$HOST
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
MailProg=/bin/true
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# No cgroups in a container: processes are tracked through /proc, no task binding, no accounting.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# Keep finished jobs in scontrol for an hour (there is no accounting database for sacct).
MinJobAge=3600
SlurmdTimeout=300
InactiveLimit=0
KillWait=30
NodeName=$HOST CPUs=$NCPUS RealMemory=$real_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
    CONF_CHANGED=0
    if ! cmp -s "$new" "$SLURM_CONF"; then
        if [[ -f $SLURM_CONF ]]; then
            cp -p "$SLURM_CONF" "$SLURM_CONF.bak.$(date -u +%Y%m%d%H%M%S)"
            log "slurm.conf changed: old one kept as $SLURM_CONF.bak.*"
        fi
        install -m 0644 "$new" "$SLURM_CONF"
        CONF_CHANGED=1
        log "wrote $SLURM_CONF"
    else
        log "$SLURM_CONF is up to date"
    fi
    rm -f "$new"
}

start_slurm() {
    install -d -o slurm -g slurm -m 0755 /var/spool/slurmctld /var/log/slurm
    install -d -o root -g root -m 0755 /var/spool/slurmd
    if [[ $CONF_CHANGED == 1 ]]; then
        stop_daemon /run/slurmd.pid slurmd
        stop_daemon /run/slurmctld.pid slurmctld
    fi
    if pid_alive /run/slurmctld.pid slurmctld; then
        log "slurmctld is running"
    else
        log "starting slurmctld"
        slurmctld || fail "slurmctld did not start (see /var/log/slurm/slurmctld.log)"
    fi
    if pid_alive /run/slurmd.pid slurmd; then
        log "slurmd is running"
    else
        log "starting slurmd"
        slurmd || fail "slurmd did not start (see /var/log/slurm/slurmd.log)"
    fi
}

wait_node_idle() {
    local state=""
    for i in $(seq 1 60); do
        state=$(sinfo -h -N -n "$HOST" -o %T 2>/dev/null | head -1)
        case $state in
            idle) log "node $HOST is idle"; return 0 ;;
            down* | drain* | fail*)
                if ((i % 5 == 1)); then
                    log "node $HOST is $state: resuming it ($(sinfo -h -N -n "$HOST" -o %E))"
                    scontrol update nodename="$HOST" state=resume 2>/dev/null || true
                fi
                ;;
        esac
        sleep 2
    done
    sinfo -N -l
    tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log
    fail "node $HOST is not idle after 120 s (state: ${state:-none})"
}

# ---------------------------------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------------------------------
job_field() {  # job_field <job id> <Field>: from `scontrol show job` (kept for MinJobAge after the end)
    scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -1
}

wait_job() {  # wait_job <job id> <timeout s>: prints the final JobState
    local state deadline=$((SECONDS + $2))
    while ((SECONDS < deadline)); do
        state=$(job_field "$1" JobState)
        case $state in
            COMPLETED | FAILED | CANCELLED* | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | PREEMPTED | BOOT_FAIL | DEADLINE)
                echo "$state"
                return 0
                ;;
        esac
        sleep 5
    done
    log "job $1 still ${state:-unknown} after $2 s: cancelling it" >&2
    scancel "$1" 2>/dev/null || true
    echo "TIMEOUT_WAITING"
}

check_run_dir() {  # check_run_dir <run dir> <steps>: metrics.jsonl has the steps, summary.json completed
    "$PYTHON" - "$1" "$2" <<'PY'
import json, sys
from pathlib import Path

run_dir, want = Path(sys.argv[1]), int(sys.argv[2])
from rlhf_orch.logging.base import read_metrics

steps = [r.get("step") for r in read_metrics(run_dir)]  # (records of steps run again after a requeue are marked superseded)
summary = json.loads((run_dir / "summary.json").read_text())
ok = steps == list(range(1, want + 1)) and summary.get("status") == "completed" and summary.get("steps") == want
print(f"  {run_dir}: metrics.jsonl steps {steps}, summary.json status={summary.get('status')} "
      f"steps={summary.get('steps')} wall_s={summary.get('wall_s')}")
sys.exit(0 if ok else 1)
PY
}

part_sbatch() {
    local run_dir="$WORK_DIR/sbatch_run" out="$WORK_DIR/slurm-ray_cluster-%j.out" job state exit_code t0 wall
    rm -rf "$run_dir"
    t0=$SECONDS
    # --gpus-per-node=0 overrides the template's `#SBATCH --gpus-per-node=8`, which this Slurm (no GPU
    # gres) refuses: "Invalid generic resource (gres) specification". RAY_NUM_CPUS: the quick plan
    # reserves one logical CPU per process (4), more than this node's cores.
    job=$(sbatch --parsable --partition="$PARTITION" --nodes=1 --gpus-per-node=0 --cpus-per-task="$NCPUS" \
        --exclusive --time=00:20:00 --output="$out" --chdir="$REPO" \
        --export="ALL,RLHF_ORCH_PYTHON=$PYTHON,RLHF_ORCH_REPO=$REPO,RAY_NUM_CPUS=$RAY_NUM_CPUS" \
        "$REPO/launchers/slurm/ray_cluster.sbatch" \
        experiment=quick placement=cpu_local "hydra.run.dir=$run_dir") || fail "sbatch refused the template"
    job=${job%%;*}
    out=${out//%j/$job}
    log "submitted launchers/slurm/ray_cluster.sbatch as job $job (output $out)"
    state=$(wait_job "$job" "$JOB_TIMEOUT_S")
    wall=$((SECONDS - t0))
    exit_code=$(job_field "$job" ExitCode)
    log "job $job: $state, ExitCode=$exit_code, ${wall} s from submission to end"
    if [[ $state != COMPLETED || $exit_code != 0:0 ]] || ! check_run_dir "$run_dir" 2; then
        echo "---- $out"
        cat "$out" 2>/dev/null || echo "(no output file)"
        fail "ray_cluster.sbatch job $job ($state, ExitCode=$exit_code)"
    fi
    tail -3 "$out"
    pass "ray_cluster.sbatch: job $job COMPLETED, ExitCode 0:0, 2 steps, summary completed (${wall} s)"
}

part_requeue() {
    # A job requeued mid-run continues its own run: the template gives the job one run dir
    # (outputs/<experiment>/slurm-<id>) and the requeued attempt resume=run_dir. A decoy -- a newer
    # checkpoint of the same experiment in another run dir, what resume=auto would take -- is
    # planted before the requeue; the second attempt must resume the job's own checkpoint.
    local out="$WORK_DIR/slurm-requeue-%j.out" job run_dir decoy ck state exit_code t0 wall deadline
    t0=$SECONDS
    job=$(sbatch --parsable --partition="$PARTITION" --nodes=1 --gpus-per-node=0 --cpus-per-task="$NCPUS" \
        --exclusive --time=00:20:00 --output="$out" --chdir="$REPO" --requeue --open-mode=append \
        --export="ALL,RLHF_ORCH_PYTHON=$PYTHON,RLHF_ORCH_REPO=$REPO,RAY_NUM_CPUS=$RAY_NUM_CPUS" \
        "$REPO/launchers/slurm/ray_cluster.sbatch" \
        experiment=quick placement=cpu_local algo.num_steps=100 checkpoint.every_n_steps=10 \
        checkpoint.export_final=false) || fail "sbatch refused the template"
    job=${job%%;*}
    out=${out//%j/$job}
    run_dir="$REPO/outputs/quick/slurm-$job"
    decoy="$REPO/outputs/quick/slurm-decoy-$job"
    log "submitted job $job (run dir $run_dir, output $out): waiting for its first checkpoint"
    deadline=$((SECONDS + JOB_TIMEOUT_S))
    ck="$run_dir/checkpoints/step_00000010"
    until [[ -f $ck/manifest.json ]]; do
        ((SECONDS < deadline)) || { cat "$out"; fail "job $job wrote no checkpoint of step 10"; }
        sleep 2
    done
    # The decoy: that checkpoint copied into another run dir of the experiment, claiming to be a
    # later step written later (resume=auto would take it).
    mkdir -p "$decoy/checkpoints"
    cp -r "$ck" "$decoy/checkpoints/step_00000050"
    "$PYTHON" - "$decoy/checkpoints/step_00000050/manifest.json" "$decoy" <<'PY'
import json, sys, time
path, run_dir = sys.argv[1], sys.argv[2]
manifest = json.load(open(path))
manifest.update(step=50, run_dir=run_dir, written_at=time.time() + 3600)
json.dump(manifest, open(path, "w"))
PY
    log "requeueing job $job (a decoy checkpoint of step 50 planted in $decoy)"
    scontrol requeue "$job" || fail "scontrol requeue $job"
    sleep 5
    state=$(wait_job "$job" "$JOB_TIMEOUT_S")
    wall=$((SECONDS - t0))
    exit_code=$(job_field "$job" ExitCode)
    log "job $job: $state, ExitCode=$exit_code, restarts $(job_field "$job" Restarts), ${wall} s from submission to end"
    if [[ $state != COMPLETED || $exit_code != 0:0 ]] || ! check_run_dir "$run_dir" 100 \
        || ! grep -q "resuming from step [0-9]*: .*outputs/quick/slurm-$job/checkpoints/" "$out" || grep -q "resuming from step 50" "$out"; then
        echo "---- $out"
        cat "$out" 2>/dev/null || echo "(no output file)"
        fail "requeued job $job did not continue its own run"
    fi
    grep "resuming from step" "$out"
    rm -rf "$run_dir" "$decoy"
    pass "requeued ray_cluster.sbatch job $job resumed its own checkpoint (not the newer decoy), 100 steps, completed (${wall} s)"
}

part_sweep() {
    local sweep_dir="$WORK_DIR/sweep_kl_coef" t0 wall rc ids id state exit_code bad=0
    rm -rf "$sweep_dir"
    t0=$SECONDS
    log "sweep: run.py -m hydra/launcher=submitit_slurm sweep=kl_coef ... (Slurm jobs, the driver waits)"
    (cd "$REPO" && timeout "$JOB_TIMEOUT_S" "$PYTHON" run.py -m hydra/launcher=submitit_slurm sweep=kl_coef \
        experiment=quick algo.num_steps=1 'algo.kl_coef=0.0,0.01' "hydra.sweep.dir=$sweep_dir" \
        hydra.launcher.partition="$PARTITION" hydra.launcher.cpus_per_task="$NCPUS" \
        hydra.launcher.timeout_min=20) >"$WORK_DIR/sweep_driver.log" 2>&1
    rc=$?
    wall=$((SECONDS - t0))
    log "sweep driver exited $rc after ${wall} s (log $WORK_DIR/sweep_driver.log)"
    ids=$(ls "$sweep_dir/.submitit" 2>/dev/null | grep -E '^[0-9]+_[0-9]+$' | sort -u)
    for id in $ids; do
        # The driver returns once every job has written its result; the job itself ends moments later.
        state=$(wait_job "$id" 120)
        exit_code=$(job_field "$id" ExitCode)
        log "  Slurm job $id: ${state:-unknown}, ExitCode=${exit_code:-?}"
        [[ $state == COMPLETED && $exit_code == 0:0 ]] || bad=1
    done
    [[ $(wc -w <<<"$ids") -eq 2 ]] || bad=1
    if ((bad == 0 && rc == 0)); then
        "$PYTHON" - "$sweep_dir/summary.csv" <<'PY' || bad=1
import csv, sys

rows = list(csv.DictReader(open(sys.argv[1])))
for r in rows:
    print(f"  summary.csv: job {r['job']} {r['label']}: status={r['status']} steps={r['steps']} wall_s={r['wall_s']}")
sys.exit(0 if len(rows) == 2 and all(r["status"] == "completed" for r in rows) else 1)
PY
    fi
    if ((bad != 0 || rc != 0)); then
        echo "---- $WORK_DIR/sweep_driver.log (last 60 lines)"
        tail -60 "$WORK_DIR/sweep_driver.log"
        for f in "$sweep_dir"/.submitit/*/*_log.out "$sweep_dir"/.submitit/*/*_log.err; do
            [[ -f $f ]] && { echo "---- $f (last 40 lines)"; tail -40 "$f"; }
        done
        fail "submitit_slurm sweep (driver exit $rc)"
    fi
    pass "submitit_slurm sweep kl_coef=0.0,0.01: 2 Slurm jobs COMPLETED, summary.csv 2 completed rows (${wall} s)"
}

if want setup; then
    install_packages
    start_munge
    write_slurm_conf
    start_slurm
    wait_node_idle
    pass "single-node Slurm: $(sinfo -h -o '%P %D %c %T' | head -1)"
fi
if want sbatch; then
    part_sbatch
fi
if want requeue; then
    part_requeue
fi
if want sweep; then
    part_sweep
fi
summary
log "all requested parts passed (work dir $WORK_DIR)"
