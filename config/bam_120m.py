# The paper's l12 ("120M") BAM+SSMax run, in the authors' setup:
#     python prepare_fineweb.py                                    # 11.9B mistral tokens -> data/fineweb_mistral
#     torchrun --standalone --nproc_per_node=8 train.py config/bam_120m.py
# Data as the authors build it: their Mistral v3 tokenizer (32,768 tokens; l12 has 121,130,496 parameters, the
# paper's 121.13M), every document BOS ... EOS with the document mask starting at BOS, validation = the first
# 3,932,160 tokens, then a 1,000,000-token gap, then training. The recipe reads 20,000 x 589,824 = 11.8B tokens,
# more than FineWeb sample-10BT (about 10B gpt2 tokens) provides, so prepare_fineweb.py takes them from
# sample-100BT and no token is read twice (train.py refuses to start a run that would repeat data;
# allow_data_repeat=True permits it).
# gpt2 is one flag away (148.07M parameters with its 50,304 padded vocabulary):
#     python prepare_fineweb.py --tokenizer gpt2 && train.py config/bam_120m.py --data_dir=data/fineweb_gpt2
# What still differs from the authors' runs: their sample-10BT stream (about 10B gpt2 tokens) was shorter than the
# 11.8B tokens read, so part of it was read twice; this run reads fresh sample-100BT documents instead.
# Every other variant of the sweep uses the same recipe, e.g.
#     ... train.py config/bam_120m.py --pos_encoding=rope --ssmax=False --out_dir=out/l12_rope
# (pos_encoding: nope | sinusoidal | rope | alibi | bam; ssmax: True | False; other sizes: --model_size=l6 ... l24).
out_dir = "out/l12_bam_ssmax"
data_dir = "data/fineweb_mistral"  # python prepare_fineweb.py (mistral tokenizer, sample-100BT, 11.9B tokens)
allow_data_repeat = False

model_size = "l12"             # 12 layers, n_embd 768, 16 heads of 48
pos_encoding = "bam"
ssmax = True
bam_init = "zero"              # theta_alpha = theta_beta = 0: BAM starts as NoPE (the authors' current default)

# 589,824 tokens per step = 1152 sequences x 512. batch_size 48 per GPU fits an 80 GB GPU with room to spare;
# gradient accumulation makes up the rest: 3 micro-batches on 8 GPUs, 24 on one. The world size must divide
# 1152 / 48 = 24 (1, 2, 3, 4, 6, 8, 12 or 24 GPUs); otherwise pick another batch_size that divides 1152 / world size.
block_size = 512
batch_size = 48
tokens_per_step = 589824
max_iters = 20000              # 11.8B tokens, each read once

# RAdam (0.9, 0.95), decoupled weight decay 0.1 on >= 2-D weights, cosine 1e-3 -> 1e-4 without warmup
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 0
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

# validation: the val split is the first 3,932,160 tokens = 7679 windows of 512; 159 batches of 48 cover 99.4%
eval_interval = 250
eval_iters = 159
log_interval = 10
ckpt_interval = 1000
keep_last = 2

dtype = "bfloat16"
compile = True
seed = 42
