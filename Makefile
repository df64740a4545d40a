# make demo   - the CPU demo end to end (train tiny models, evaluate passkey retrieval, write figures)
# make demo-text - the text demo: six runs trained on English, perplexity to 64x the training length
# make zoo    - the published priors side by side on both demos (results/zoo/README.md)
# make test   - the default test suite (what CI runs)
# All use the active virtual environment, or create .venv: the demos install requirements.txt (what they import),
# make test requirements-dev.txt (that, and the tests, the linter and the lm-eval adapter).
ifdef VIRTUAL_ENV
PYTHON := $(VIRTUAL_ENV)/bin/python
STAMP := $(VIRTUAL_ENV)/.bam-gpt
else
PYTHON := .venv/bin/python
STAMP := .venv/.bam-gpt
endif

.PHONY: deps dev-deps test test-all demo demo-text zoo gpu-check

$(STAMP)-%: %.txt requirements.txt
	@test -x $(PYTHON) || python3 -m venv .venv
	$(PYTHON) -m pip install -q -r $<
	@touch $@

deps: $(STAMP)-requirements
dev-deps: $(STAMP)-requirements-dev

# the formatter and the linter first (pyproject.toml's settings), so that CI keeps the layout; then
# the tests in TEST_JOBS processes (pytest-xdist), one a core; an idle process takes tests queued
# for a busy one (worksteal), so that a few long tests do not leave a core waiting at the end
TEST_JOBS ?= 2
test: dev-deps
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -n $(TEST_JOBS) --dist worksteal -m "not slow" tests/

test-all: dev-deps
	$(PYTHON) -m pytest -q -n $(TEST_JOBS) tests/

# the GPU check's correctness tier (dev/README.md), with whatever python3 has: it installs nothing
gpu-check:
	bash dev/gpu_check.sh correctness

# ---- the CPU demo ------------------------------------------------------------------------------------------------
# Synthetic passkey data (prepare_demo.py), tiny models trained at a 64-token context (config/demo_cpu.py, DEMO_JOBS
# trainings at a time on one thread each), passkey retrieval at 1x..64x that length with the per-seed table
# (eval_passkey.py --template demo), the heads that read the needle (analysis/inspect_attention.py) and the learned
# BAM prior (analysis/plot_prior.py). Everything is written under data/demo/ and out/demo/ (ignored by git; the results in
# out/demo/results/), so the figures committed in results/demo/ are never overwritten.
#   make demo                          one seed, all four variants
#   make demo SEEDS=12 BASELINE_SEEDS=6  the seed study: BAM + SSMax on seeds 1-12, the baselines on 1-6
# A seed sets everything random (data and initialisation), so the same seed on the same CPU gives the same table. A
# run is retrained only when its checkpoint is missing or the CONTENT of config/demo_cpu.py or of its data changed
# (a sha256 stamp, rewritten only when it differs), not when only a file date did.
SEEDS ?= 1
DEMO_VARIANTS ?= bam_ssmax rope alibi nope
DEMO_LENGTHS ?= 64 128 256 512 1024 2048 4096
DEMO_DATA ?= data/demo
DEMO_OUT ?= out/demo
DEMO_RESULTS ?= $(DEMO_OUT)/results
DEMO_PREPARE_ARGS ?=
DEMO_TRAIN_ARGS ?=
DEMO_EVAL_ARGS ?=
BASELINE_SEEDS ?= $(SEEDS)
DEMO_JOBS ?= 2
# seed by seed (every variant of seed 1 first), the baselines only up to BASELINE_SEEDS
baseline_seeds := $(shell seq 1 $(BASELINE_SEEDS))
demo_runs := $(foreach s,$(shell seq 1 $(SEEDS)),$(foreach v,$(DEMO_VARIANTS),\
	$(if $(or $(filter bam%,$(v)),$(filter $(s),$(baseline_seeds))),$(v)-s$(s))))
# run name <variant>-s<seed>, variant <base>[_ssmax]: base an encoding (bam: its GGD prior), or the name of a
# registered prior, learned as pos_encoding=bam from that prior's default init
ENCODINGS := nope sinusoidal rope alibi bam
demo_seed = $(lastword $(subst -s, ,$(1)))
demo_variant = $(firstword $(subst -s, ,$(1)))
demo_base = $(patsubst %_ssmax,%,$(call demo_variant,$(1)))
demo_flags = $(if $(filter $(call demo_base,$(1)),$(ENCODINGS)),--pos_encoding=$(call demo_base,$(1)),\
	--pos_encoding=bam --prior=$(call demo_base,$(1)) --bam_init=default) \
	--ssmax=$(if $(filter %_ssmax,$(call demo_variant,$(1))),True,False) --seed=$(call demo_seed,$(1))

# $(call train_run,CONFIG,OUT,RUN,DATA_DIR,EXTRA_ARGS): one training of a demo on one thread, run
# RUN (<variant>-s<seed>) into OUT/RUN, logged to OUT/RUN.log; both demos train through it
define train_run
@rm -rf $(2)/$(3) && mkdir -p $(2) && echo "training $(3) (log: $(2)/$(3).log)"
OMP_NUM_THREADS=1 $(PYTHON) train.py $(1) --out_dir=$(2)/$(3) --data_dir=$(4) $(call demo_flags,$(3)) \
	$(5) > $(2)/$(3).log 2>&1 || (tail -n 20 $(2)/$(3).log; exit 1)
@tail -n 1 $(2)/$(3).log
@touch $(2)/$(3)/done
endef

demo: deps
	$(MAKE) --no-print-directory -j$(DEMO_JOBS) $(demo_runs:%=$(DEMO_OUT)/%/done)
	rm -f $(DEMO_RESULTS)/passkey_*
	$(PYTHON) eval_passkey.py --template demo $(demo_runs:%=--ckpt $(DEMO_OUT)/%) --lengths $(DEMO_LENGTHS) \
		--out $(DEMO_RESULTS) --no_progress $(DEMO_EVAL_ARGS)
	$(PYTHON) analysis/inspect_attention.py --template demo $(patsubst %,--ckpt $(DEMO_OUT)/%,$(filter %-s1,$(demo_runs))) \
		--lengths $(DEMO_LENGTHS) --samples 10 --out $(DEMO_RESULTS) --no_progress
	$(foreach r,$(filter bam%,$(demo_runs)),$(PYTHON) analysis/plot_prior.py --ckpt $(DEMO_OUT)/$(r) --out $(DEMO_RESULTS)/prior_$(r).png && ) true

# $(call content_stamp,FILES,STAMP): write the sha256 of FILES to STAMP only when it differs. Make looks at the
# stamp's date again after its recipe, so whatever depends on it is rebuilt only when the content changed.
sha256 = $(PYTHON) -c "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())"
content_stamp = new=$$(cat $(1) | $(sha256)) && { [ "$$new" = "$$(cat $(2) 2>/dev/null)" ] || echo "$$new" > $(2); }

$(DEMO_DATA)/s%/demo_meta.json: prepare_demo.py
	$(PYTHON) prepare_demo.py --seed $* --out_dir $(DEMO_DATA)/s$* $(DEMO_PREPARE_ARGS)
$(DEMO_DATA)/s%/content.sha256: $(DEMO_DATA)/s%/demo_meta.json
	@$(call content_stamp,$(@D)/demo_meta.json $(@D)/demo_*.bin,$@)
$(DEMO_OUT)/config.sha256: config/demo_cpu.py
	@mkdir -p $(@D) && $(call content_stamp,$<,$@)
.PRECIOUS: $(DEMO_DATA)/s%/demo_meta.json $(DEMO_DATA)/s%/content.sha256

.SECONDEXPANSION:
$(DEMO_OUT)/%/done: $(DEMO_OUT)/config.sha256 $(DEMO_DATA)/s$$(call demo_seed,$$*)/content.sha256
	$(call train_run,config/demo_cpu.py,$(DEMO_OUT),$*,$(DEMO_DATA)/s$(call demo_seed,$*),$(DEMO_TRAIN_ARGS))

# ---- the text demo -----------------------------------------------------------------------------------
# Real English (the King James Bible, extracted by prepare_fineweb.py from an installed package, byte
# tokens), six runs (the five encodings and BAM + SSMax) trained at a 64-token context
# (config/text_cpu.py, DEMO_JOBS trainings at a time on one thread each), then perplexity along the position axis to 64x that length (eval_ppl.py),
# with the per-seed table at 1x..64x, and the learned BAM priors (analysis/plot_prior.py). Everything is
# written under data/text/ and out/text/ (the results in out/text/results/); results/text/ is never
# overwritten.
#   make demo-text            one seed, all six runs
#   make demo-text SEEDS=3    the seed study: the median and worst seed per length
# A run is retrained only when its checkpoint is missing or the content of config/text_cpu.py or of
# the data changed, as in make demo.
TEXT_VARIANTS ?= nope sinusoidal rope alibi bam bam_ssmax
TEXT_DATA ?= data/text
TEXT_OUT ?= out/text
TEXT_RESULTS ?= $(TEXT_OUT)/results
TEXT_PREPARE_ARGS ?=
TEXT_TRAIN_ARGS ?=
TEXT_EVAL_ARGS ?= --seq_len 4096 --window 64 --num_seqs 16
text_runs := $(foreach s,$(shell seq 1 $(SEEDS)),$(foreach v,$(TEXT_VARIANTS),$(v)-s$(s)))

demo-text: deps
	$(MAKE) --no-print-directory -j$(DEMO_JOBS) $(text_runs:%=$(TEXT_OUT)/%/done)
	rm -f $(TEXT_RESULTS)/ppl_*
	$(PYTHON) eval_ppl.py $(text_runs:%=--ckpt $(TEXT_OUT)/%) --out $(TEXT_RESULTS) $(TEXT_EVAL_ARGS)
	cp $(TEXT_DATA)/corpus.json $(TEXT_RESULTS)/corpus.json
	$(foreach r,$(filter bam%,$(text_runs)),$(PYTHON) analysis/plot_prior.py --ckpt $(TEXT_OUT)/$(r) --out $(TEXT_RESULTS)/prior_$(r).png && ) true

$(TEXT_DATA)/corpus.json: prepare_fineweb.py
	$(PYTHON) prepare_fineweb.py --dataset kjv --tokenizer byte --val_tokens 262144 --gap_tokens 0 \
	  --num_proc 1 --out_dir $(TEXT_DATA) $(TEXT_PREPARE_ARGS)
$(TEXT_DATA)/content.sha256: $(TEXT_DATA)/corpus.json
	@$(call content_stamp,$(@D)/corpus.json $(@D)/kjv_*.bin,$@)
$(TEXT_OUT)/config.sha256: config/text_cpu.py
	@mkdir -p $(@D) && $(call content_stamp,$<,$@)
.PRECIOUS: $(TEXT_DATA)/corpus.json $(TEXT_DATA)/content.sha256

$(TEXT_OUT)/%/done: $(TEXT_OUT)/config.sha256 $(TEXT_DATA)/content.sha256
	$(call train_run,config/text_cpu.py,$(TEXT_OUT),$*,$(TEXT_DATA),$(TEXT_TRAIN_ARGS))

# ---- the zoo of priors -------------------------------------------------------------------------------
# Every registered prior beside the encodings, on both demos with their own recipes: the passkey demo's runs train
# into $(DEMO_OUT) and the text demo's into $(TEXT_OUT), so that a run either demo already trained is reused, then
# passkey retrieval and perplexity to 64x for every run, and the learned priors of seed 1. Results in out/zoo/
# (results/zoo/ is never overwritten). The evaluations keep their per-sample logs there, so that a later call
# (more seeds) evaluates only the new runs.
#   make zoo            one seed (about 45 min on 2 cores)
#   make zoo SEEDS=3    the study in results/zoo/ (about 2 1/4 h)
ZOO_VARIANTS ?= nope alibi bam cauchy bam_ssmax kerple_log kerple_log_ssmax kerple_power kerple_power_ssmax \
	t5_bucket t5_bucket_ssmax sandwich sandwich_ssmax mlp mlp_ssmax
ZOO_RESULTS ?= out/zoo/results
zoo_runs := $(foreach s,$(shell seq 1 $(SEEDS)),$(foreach v,$(ZOO_VARIANTS),$(v)-s$(s)))
zoo_plots := $(filter-out nope-%,$(filter %-s1,$(zoo_runs)))

zoo: deps
	$(MAKE) --no-print-directory -j$(DEMO_JOBS) $(foreach r,$(zoo_runs),$(DEMO_OUT)/$(r)/done $(TEXT_OUT)/$(r)/done)
	rm -f $(ZOO_RESULTS)/passkey_summary.* $(ZOO_RESULTS)/ppl_summary.* $(ZOO_RESULTS)/*_table.*
	$(PYTHON) eval_passkey.py --template demo $(zoo_runs:%=--ckpt $(DEMO_OUT)/%) --lengths $(DEMO_LENGTHS) \
		--out $(ZOO_RESULTS) --no_progress $(DEMO_EVAL_ARGS)
	$(PYTHON) eval_ppl.py $(zoo_runs:%=--ckpt $(TEXT_OUT)/%) --out $(ZOO_RESULTS) $(TEXT_EVAL_ARGS)
	cp $(TEXT_DATA)/corpus.json $(ZOO_RESULTS)/corpus.json
	$(foreach r,$(zoo_plots),$(PYTHON) analysis/plot_prior.py --ckpt $(DEMO_OUT)/$(r) --out $(ZOO_RESULTS)/prior_passkey_$(r).png && \
		$(PYTHON) analysis/plot_prior.py --ckpt $(TEXT_OUT)/$(r) --out $(ZOO_RESULTS)/prior_text_$(r).png && ) true
