#!/usr/bin/env bash
# CI step (.ci/run): the range of dependencies setup.cfg's install_requires claims, not
# only the one snapshot the README's environment happens to resolve.
#
# cloudpickle 3.1.3 once changed what every pickled code object says its file is, and CI
# did not notice, because it only ever ran the newest release. So each job below builds
# its own virtual environment (in a temporary folder, removed at the end), prints the
# versions it really got, runs pytest and its counts, and times itself:
#
#   pickling-floor   cloudpickle and tblib at the lowest releases setup.cfg admits, with
#                    the tests that pickle functions, errors, tracebacks and stacks
#   torch-newest     the newest torch this machine's pip offers, with the tests of what
#                    mplaunch does with torch (TORCH_TESTS below)
#   torch-floor      the lowest torch setup.cfg admits (2.1.2, with numpy<2, which it
#                    was built against), the same tests
#   ray-floor        the lowest Ray the extra mplaunch[ray] admits, with the Ray World's
#                    tests (the README's environment runs every ray test with the newest)
#
# The newest cloudpickle and tblib have no job of their own: the README's environment
# is a fresh `pip install -e '.[test]'`, which resolves the newest releases setup.cfg
# admits, and runs every test with them (its pip list is in the log). CI has 90 minutes
# on 2 cores, and this script's jobs are about a third of them.
#
# A job that fails fails this step (exit 1), after every job has run.
# MPLAUNCH_DEPS_JOBS="pickling-floor torch-floor" runs only the jobs named.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# What setup.cfg's floors are today; a test keeps these in step with setup.cfg.
CLOUDPICKLE_FLOOR=2.2.0
TBLIB_FLOOR=3.0.0
TORCH_FLOOR=2.1.2
RAY_FLOOR=2.10.0
TORCH_CPU=2.13.0          # the README's CPU build: the pickling jobs need a torch, not this one

# The tests that ship code, results and exceptions between processes and show their
# frames: checked under the floors of cloudpickle and tblib (the notebook ones too,
# where cloudpickle ships a kernel's functions by value).
PICKLING_TESTS=(-m "not slow" tests/test_pickler.py tests/test_errors.py tests/test_reports.py
                tests/test_insight.py tests/test_user_main.py tests/test_crash_matrix.py
                tests/test_plugin.py tests/test_plugin_reuse.py tests/test_notebook.py
                tests/test_world_main.py tests/test_inputs.py)
# What mplaunch does with torch, which a torch release can change: the process group's
# set-up and every init form, heals (release, rebuild, group state, subgroups),
# interrupts inside collectives, tensors sent and received, the collectives named in
# stacks and hangs, torchrun's environment and flags, devices. The rest of the suite
# (launching, output, signals, pickling, the plugin) does not depend on the torch
# release and runs once, in the README's job, as do the slow and notebook tests (what a
# kernel adds is IPython's, not torch's). About 6 minutes each on CI's 2 cores.
TORCH_TESTS=(-m "not no_torch and not slurm and not slow and not notebook"
             tests/test_torch_api.py tests/test_init_forms.py tests/test_heal.py
             tests/test_release.py tests/test_release_subgroups.py tests/test_interrupts.py
             tests/test_world.py tests/test_world_ledger.py tests/test_inputs.py
             tests/test_inputs_globals.py tests/test_basic.py tests/test_error_tails.py
             tests/test_insight.py tests/test_timeout.py tests/test_cli_torchrun.py
             tests/test_gpus.py tests/test_devices.py tests/test_stragglers.py)

jobs_wanted=${MPLAUNCH_DEPS_JOBS:-pickling-floor torch-newest torch-floor ray-floor}
failed=()
summary=()

run_job() {  # run_job NAME "pip install steps, ;-separated" PYTEST_ARGS...
    local name=$1 steps=$2
    shift 2
    case " $jobs_wanted " in *" $name "*) ;; *) return 0 ;; esac
    local venv="$work/$name" log="$work/$name.log" start=$SECONDS rc=0
    echo "== deps: $name"
    (
        set -euo pipefail
        "$python" -m venv "$venv"
        # shellcheck disable=SC1091
        . "$venv/bin/activate"
        IFS=';' read -ra cmds <<< "$steps"
        for cmd in "${cmds[@]}"; do
            echo "   \$ $cmd"
            bash -euo pipefail -c "$cmd" > "$work/$name.pip" 2>&1 \
                || { tail -n 30 "$work/$name.pip"; exit 1; }
        done
        python - <<'EOF'
import importlib.metadata as md, sys
names = ["torch", "cloudpickle", "tblib", "pytest", "numpy", "ipykernel", "ipython", "ray"]
def version(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return None
print("   versions: Python " + sys.version.split()[0] + ", "
      + ", ".join(f"{n} {version(n)}" for n in names if version(n)))
EOF
        MPLAUNCH_TEST_SHARED_MACHINE=1 python -m pytest -p no:cacheprovider -q "$@"
    ) > "$log" 2>&1 || rc=$?
    local took=$((SECONDS - start))
    local versions counts
    versions=$(grep -m1 '^   versions:' "$log" | sed 's/^   versions: //' || true)
    counts=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)' "$log" | tail -n 1 \
             | sed 's/=//g; s/^ *//; s/ *$//' || true)
    if [ "$rc" -ne 0 ]; then
        failed+=("$name")
        echo "   FAILED (exit $rc): the end of its log:"
        tail -n 60 "$log" | sed 's/^/   | /'
    else
        sed -n '/^   /p' "$log"
    fi
    echo "   $name: ${counts:-no pytest summary} in ${took} s"
    summary+=("$(printf '%-16s %5d s  %-6s %s | %s' "$name" "$took" \
        "$([ "$rc" -eq 0 ] && echo ok || echo FAILED)" "${counts:-no pytest summary}" "$versions")")
}

run_job pickling-floor \
    "pip install torch==$TORCH_CPU; pip install -e '.[test]' cloudpickle==$CLOUDPICKLE_FLOOR tblib==$TBLIB_FLOOR" \
    "${PICKLING_TESTS[@]}"
run_job torch-newest \
    "pip install --upgrade torch; pip install -e '.[test]'" \
    "${TORCH_TESTS[@]}"
# torch 2.1 was built against numpy 1 and cannot import numpy 2's arrays.
run_job torch-floor \
    "pip install torch==$TORCH_FLOOR 'numpy<2'; pip install -e '.[test]'" \
    "${TORCH_TESTS[@]}"

run_job ray-floor \
    "pip install torch==$TORCH_CPU; pip install -e '.[test]' ray==$RAY_FLOOR" \
    -m ray tests/test_ray_world.py

echo "== deps: summary (job, seconds, result, pytest counts | versions)"
printf '   %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: the dependency jobs ${failed[*]}" >&2
    exit 1
fi
