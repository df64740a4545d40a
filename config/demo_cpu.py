# The CPU demo (make demo): a model of about 205K parameters trained on prepare_demo.py's synthetic
# passkey corpus at a 64-token context, then asked for the passkey at up to 64x that length
# (eval_passkey.py --template demo). Runs on one CPU thread; `make demo` trains two variants at a
# time.
# Training is by iteration count, so one seed gives one model. Override anything with --key=value,
# e.g. --pos_encoding=rope --ssmax=False --seed=2.
out_dir = "out/demo/bam_ssmax-s1"
data_dir = "data/demo"
device = "cpu"
dtype = "float32"
compile = False
seed = 1
# data: one window = one row; prepare_demo.py writes windows of whole documents of this length
block_size = 64
batch_size = 16
gradient_accumulation_steps = 1  # a step is one batch of 16 windows
# model: 4 layers, 8 heads of 8 dims. With 3 layers, or with weight decay, some seeds lost the
# digit-by-digit copy of the key beyond 4x (results/demo/README.md has the search)
n_layer = 4
n_head = 8
n_embd = 64
pos_encoding = "bam"
ssmax = True
scale_prior = True  # the paper's placement: (q.k/sqrt(d) + prior) * s log n
bam_init = "zero"  # theta_alpha = theta_beta = 0: a flat prior (NoPE), the authors' current default
# optimizer (RAdam, decoupled weight decay, cosine to min_lr)
max_iters = 3000
learning_rate = 2e-3
min_lr = 2e-4
weight_decay = 0.0  # none: see the model's comment above
# the prior's two scalars per head learn 10x faster than the weights: at 1e-2 one seed in 12 kept a
# nearly flat prior in a head that then read the haystack's mean from 4x
prior_lr = 2e-2
ssmax_lr = 2e-3  # SSMax s at the base rate: 1e-2 let s collapse to ~0 (or < 0) in some heads
# logging and checkpoints
eval_interval = 500
eval_iters = 8
log_interval = 100
ckpt_interval = 3000
keep_last = 1
