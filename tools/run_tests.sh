#!/usr/bin/env bash
# The project's test command: set up .venv when needed, build the extension, run pytest.
#   bash tools/run_tests.sh [pytest args...]
# A second run skips whatever is already up to date (stamps hold hashes of the inputs).
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"
# shellcheck source=tools/setup_env.sh
source tools/setup_env.sh

# The optional requirement of --tensorboard-dir (requirements-tensorboard.txt; not in requirements.txt, which
# tools/gpu_check.sh installs from a carried folder of wheels), for its tests. pip runs as setup_env.sh's does, so
# PIP_NO_INDEX / PIP_FIND_LINKS hold; where it cannot install, one line says so and those tests skip (no stamp: the
# next run tries again).
tensorboard_stamp="$venv/.tensorboard-$(file_hash requirements-tensorboard.txt)"
if [ ! -f "$tensorboard_stamp" ]; then
    log "installing the optional TensorBoard requirement (requirements-tensorboard.txt)"
    pip_quiet -r requirements-tensorboard.txt
    if "$VENV_PY" -c 'import tensorboard' 2>/dev/null; then
        rm -f "$venv"/.tensorboard-*
        touch "$tensorboard_stamp"
    else
        log "tensorboard did not install (see pip's output above): the --tensorboard-dir tests will skip"
    fi
fi

# The newest supported megatron-core gets the tests that exercise Megatron's API in a second environment: after
# the whole suite, LATEST_TESTS; after a targeted run, the same selection, but only with MEGATRON_APP_TEST_LATEST=1
# (=0 skips the second run also after the whole suite).
LATEST_TESTS=(tests/test_megatron_compat.py tests/test_forward_backward_contract.py tests/test_runtime.py
              tests/test_pipeline_equality.py tests/test_megatron_schedule_tests.py tests/test_optimizer_flags.py
              tests/test_model_flags.py tests/test_weight_init.py tests/test_data_path.py tests/test_lazy_fusers.py
              tests/test_train_runs.py tests/test_recompute.py)
# The equality grid for the second run: one interleaved layout, one with tensor parallelism and dropout, and the
# Llama-shaped model's rows (RMSNorm, SwiGLU, GQA, RoPE: the modules most likely to move between versions).
LATEST_FILTER="not equality or (every_schedule and P2-V2-T1) or (dropout and P2-V2-T2) or llama"
# The transport's test files again, with the module built under AddressSanitizer + UndefinedBehaviorSanitizer
# (tools/build_sanitized.sh): after the whole suite, or with MEGATRON_APP_TEST_SANITIZE=1. Any report aborts the
# process it happens in, so the run fails.
SANITIZED_TESTS=(tests/test_transport_roundtrip.py tests/test_transport_tcp.py tests/test_transport_lifecycle.py
                 tests/test_transport_processes.py tests/test_rdma_protocol.py tests/test_lossy_transport.py
                 tests/test_transport_admission.py tests/test_wire_fuzz.py tests/test_transport_device_staging.py)
want_sanitized=${MEGATRON_APP_TEST_SANITIZE:-$([ "$#" -eq 0 ] && echo 1 || echo 0)}
want_latest=${MEGATRON_APP_TEST_LATEST:-$([ "$#" -eq 0 ] && echo 1 || echo 0)}

set +e
if [ "$#" -eq 0 ]; then
    # The whole suite runs on two pytest workers, a test file per worker at a time (module fixtures are built once;
    # tests of one file never overlap): its multi-process tests wait as much as they compute, and one at a time
    # kept 2 cores 60% busy. It lists its slowest tests: the 20-minute budget is watched from CI's log.
    "$VENV_PY" -m pytest -n 2 --dist loadfile --durations=25
else
    "$VENV_PY" -m pytest "$@"
fi
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    # pytest: "no tests collected". With a filter that is the user's choice; for the whole suite it is a fault.
    if [ "$#" -gt 0 ]; then
        echo "run_tests.sh: no tests matched: $*" >&2
        rc=0
    else
        echo "run_tests.sh: pytest collected no tests; the suite is missing" >&2
        exit 1
    fi
fi
# A targeted run sanitizes only the transport files it names (all of them after the whole suite).
sanitized_selection=("${SANITIZED_TESTS[@]}")
if [ "$#" -gt 0 ]; then
    sanitized_selection=()
    for candidate in "${SANITIZED_TESTS[@]}"; do
        for argument in "$@"; do
            case "$argument" in "$candidate"|"$candidate"::*|"./$candidate"|"./$candidate"::*)
                sanitized_selection+=("$argument") ;;
            esac
        done
    done
fi
if [ "$want_sanitized" = 1 ] && [ "${#sanitized_selection[@]}" -eq 0 ]; then
    echo "run_tests.sh: none of the files named is a transport test file; nothing to run under the sanitizers" >&2
fi
if [ "$want_sanitized" = 1 ] && [ "${#sanitized_selection[@]}" -gt 0 ]; then
    sanitized_module=$(MAPP_SANITIZE=address,undefined VENV_PY="$VENV_PY" bash tools/build_sanitized.sh) \
        || { echo "run_tests.sh: the sanitizer build failed" >&2; exit 1; }
    echo "run_tests.sh: again with the transport built under -fsanitize=address,undefined" >&2
    set +e
    # Two workers, a file each at a time, as the whole suite (94 s -> 71 s here). Python itself is not
    # instrumented: libasan must come first, and libstdc++ before the module (else ASan cannot
    # intercept C++ throws: "CHECK failed ... real___cxa_throw"); its leak checker would report the interpreter's
    # own allocations.
    MEGATRON_APP_CORE="$sanitized_module" LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libstdc++.so)" \
        ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        "$VENV_PY" -m pytest -q -n 2 --dist loadfile "${sanitized_selection[@]}"
    sanitized_rc=$?
    set -e
    [ "$rc" -ne 0 ] || rc=$sanitized_rc
fi
if [ "$want_latest" = 1 ]; then
    # shellcheck source=tools/setup_latest_megatron.sh
    source tools/setup_latest_megatron.sh
    echo "run_tests.sh: again under $("$LATEST_VENV_PY" -W ignore -c 'from megatron_app.megatron_compat import megatron_core_version as v; print("megatron-core", v())' 2>/dev/null)" >&2
    set +e
    if [ "$#" -gt 0 ]; then
        "$LATEST_VENV_PY" -m pytest "$@"
    else
        "$LATEST_VENV_PY" -m pytest -n 2 --dist loadfile "${LATEST_TESTS[@]}" -k "$LATEST_FILTER"
    fi
    latest_rc=$?
    set -e
    [ "$rc" -ne 0 ] || rc=$latest_rc
fi
exit "$rc"
