# The text demo (make demo-text): a small model trained on real English, the King James Bible
# (prepare_fineweb.py --dataset kjv, byte tokens), at a 64-token context, then scored on
# perplexity along the position axis to 64x that length (eval_ppl.py). One CPU thread per
# training; `make demo-text` trains two at a time. Override anything with --key=value, e.g.
# --pos_encoding=rope --ssmax=False.
out_dir = "out/text/bam_ssmax-s1"
data_dir = "data/text"
device = "cpu"
dtype = "float32"
compile = False
seed = 1
# data: 16 windows of 64 bytes a step, read in stream order: 2,000 steps read 2.0M of the 3.9M
# training bytes once
block_size = 64
batch_size = 16
gradient_accumulation_steps = 1
# model: the passkey demo's, 4 layers of 8 heads of 8 dims (BAM + SSMax unless overridden)
n_layer = 4
n_head = 8
n_embd = 64
bam_init = "zero"  # a flat prior (NoPE) to start, as the authors do
# optimizer (RAdam, decoupled weight decay, cosine to min_lr)
max_iters = 2000
learning_rate = 2e-3
min_lr = 2e-4
prior_lr = 2e-2  # the demo's: the prior's two scalars per head learn 10x faster than the weights
ssmax_lr = 2e-3
# logging and checkpoints
eval_interval = 1000
eval_iters = 16
log_interval = 100
ckpt_interval = 2000
keep_last = 1
