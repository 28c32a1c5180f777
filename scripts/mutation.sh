#!/usr/bin/env bash
# Mutation testing of edgespec's core with mutmut 3 (slow: not part of CI). See docs/mutation.md.
#
#   scripts/mutation.sh [GROUP...]     GROUP: rule (verify.py, sampling.py), engine (engine.py), drafters
#                                      (drafters/*.py), policy (policy.py, costmodel.py); default: rule engine
#
# Each group runs in its own scratch copy of the tracked files ($MUT_DIR/GROUP, default /tmp/edgespec-mutation),
# never in the working tree: mutmut writes its mutants/ folder there. The per-group results (counts per module
# and the diff of every surviving mutant) are written to docs/mutation-report/GROUP.txt in this checkout.
# Env: PY (python with mutmut installed, default .venv/bin/python), MAX_CHILDREN (default 2), LIMIT_S (a hard
# wall-clock limit per group, default 5400), MUTANTS (glob(s) of mutant names to run, e.g. 'edgespec.engine.*'),
# REPORT_ONLY=1 (no run: rewrite the report from $MUT_DIR/GROUP's last results).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
MUT_DIR="${MUT_DIR:-/tmp/edgespec-mutation}"
MAX_CHILDREN="${MAX_CHILDREN:-2}"
LIMIT_S="${LIMIT_S:-5400}"
GROUPS_TO_RUN=("$@")
[ ${#GROUPS_TO_RUN[@]} -eq 0 ] && GROUPS_TO_RUN=(rule engine)

"$PY" -c "import mutmut" 2>/dev/null || { echo "mutmut is not installed for $PY: run '$PY -m pip install mutmut'" >&2; exit 2; }

# The statistical tests of the engine (sampling distributions over thousands of runs) take minutes each; the
# engine group leaves them out and relies on the rule group (verify.py is where the sampling maths lives).
ENGINE_SLOW="not distribution_matches_target and not p_min_matches_target and not negative_control and not guess_rounds_matches"

config_for() {  # the [mutmut] section of setup.cfg for one group
    local only tests
    case "$1" in
        rule)     only="edgespec/verify.py edgespec/sampling.py"
                  tests="tests/test_verify.py tests/test_sampling.py tests/test_properties.py tests/test_mutants.py -k 'not engine'" ;;
        engine)   only="edgespec/engine.py"
                  tests="tests/test_engine.py tests/test_overlap.py tests/test_pieces.py tests/test_early_stop.py tests/test_notices.py tests/test_mutants.py tests/test_device_contract.py -k '$ENGINE_SLOW'" ;;
        # not drafters/base.py: mutmut's trampolines add names to the Drafter Protocol's members, so no drafter
        # passes isinstance(..., Drafter) any more and the clean run fails (test_pieces); it holds no logic
        drafters) only="edgespec/drafters/__init__.py edgespec/drafters/guard.py edgespec/drafters/model.py edgespec/drafters/ngram.py"
                  tests="tests/test_engine.py tests/test_overlap.py tests/test_pieces.py tests/test_early_stop.py tests/test_notices.py tests/test_mutants.py tests/test_device_contract.py tests/test_properties.py -k '$ENGINE_SLOW'" ;;
        policy)   only="edgespec/policy.py edgespec/costmodel.py"
                  tests="tests/test_policy.py tests/test_costmodel.py" ;;
        *) echo "unknown group '$1': use rule, engine, drafters or policy" >&2; exit 2 ;;
    esac
    {
        echo "[mutmut]"
        echo "source_paths = edgespec"
        echo "only_mutate ="; for p in $only; do echo "    $p"; done
        echo "also_copy ="; for p in tui README.md; do echo "    $p"; done
        echo "pytest_add_cli_args_test_selection ="
        # one argument per line, as mutmut's setup.cfg reader splits lists on newlines
        eval "set -- $tests"; for a in "$@"; do echo "    $a"; done
        echo "pytest_add_cli_args ="
        echo "    -p"
        echo "    no:cacheprovider"
        echo "process_isolation = forkserver"
        echo "use_git_change_detection = false"
        # a mutant that makes a test loop runs until this many times the tests' measured time (x2 CPU seconds):
        # mutmut's default of 15 let each hung engine mutant hold a worker for about 23 minutes
        echo "timeout_multiplier = 3"
    } > setup.cfg
}

for group in "${GROUPS_TO_RUN[@]}"; do
    work="$MUT_DIR/$group"
    if [ -n "${REPORT_ONLY:-}" ]; then  # rewrite the report from the last run's results (e.g. after rerunning
        cd "$work"; rc="report-only"    # survivors with `mutmut run NAME...` there)
    else
    rm -rf "$work" && mkdir -p "$work"
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$work" 2>/dev/null || true)
    cd "$work"
    config_for "$group"
    echo "== $group: $(date -u +%H:%M:%S) in $work" >&2
    # one thread per test process: the children share the machine's cores
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 EDGESPEC_DATA="$work/.data"
    set +e
    # shellcheck disable=SC2086
    timeout --signal=INT --kill-after=60 "$LIMIT_S" "$PY" -m mutmut run --max-children "$MAX_CHILDREN" ${MUTANTS:-} \
        > "$work/run.log" 2>&1
    rc=$?
    set -e
    echo "== $group: mutmut exited $rc at $(date -u +%H:%M:%S) (124/130: hit LIMIT_S=$LIMIT_S)" >&2
    fi
    mkdir -p "$ROOT/docs/mutation-report"
    "$PY" - "$group" "$rc" "$PY" > "$ROOT/docs/mutation-report/$group.txt" <<'EOF'
import collections, subprocess, sys
group, rc, py = sys.argv[1], sys.argv[2], sys.argv[3]
mm = subprocess.run([py, "-m", "pip", "show", "mutmut"], capture_output=True, text=True).stdout
version = next((l.split()[1] for l in mm.splitlines() if l.startswith("Version:")), "?")
out = subprocess.run([py, "-m", "mutmut", "results", "--all", "true"], capture_output=True, text=True).stdout
counts = collections.defaultdict(collections.Counter)
survivors = []
for line in out.splitlines():
    if ": " not in line:
        continue
    name, status = (s.strip() for s in line.rsplit(": ", 1))
    parts = name.split(".")
    module = ".".join(p for p in parts[:next((i for i, p in enumerate(parts) if p.startswith(("x_", "x\u01c1"))), len(parts))])
    counts[module][status] += 1
    if status in ("survived", "no tests", "suspicious", "not checked"):
        survivors.append((name, status))
print(f"mutmut {version}, group {group}, run exit code {rc}")
for module, c in sorted(counts.items()):
    total = sum(c.values())
    done = total - c["not checked"]
    killed = c["killed"] + c["timeout"] + c["caught by type check"]
    score = 100 * killed / done if done else 0.0
    print(f"{module}: total {total}, checked {done}, killed {c['killed']}, timeout {c['timeout']}, "
          f"survived {c['survived']}, no tests {c['no tests']}, suspicious {c['suspicious']}, "
          f"not checked {c['not checked']}, score {score:.1f}% of checked")
for name, status in survivors:
    if status == "not checked":
        continue
    print(f"\n--- {name}: {status}")
    print(subprocess.run([py, "-m", "mutmut", "show", name], capture_output=True, text=True).stdout.strip())
EOF
    cd "$ROOT"
    head -5 "docs/mutation-report/$group.txt" >&2
done
