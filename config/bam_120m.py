# The paper's l12 ("120M") BAM+SSMax run:
#     torchrun --standalone --nproc_per_node=8 train.py config/bam_120m.py
# The recipe itself (optimizer, schedule, 589,824 tokens per step, 20,000 steps, bf16, seed 42, ...) is train.py's
# defaults, the one place it is written down; this file only names the run. Every other variant of the sweep is
#     ... train.py config/bam_120m.py --pos_encoding=rope --ssmax=False --out_dir=out/l12_rope
# (pos_encoding: nope | sinusoidal | rope | alibi | bam; ssmax: True | False; other sizes: --model_size=l6 ... l24).
# batch_size 48 per GPU with gradient accumulation making up 1152 sequences per step: 3 micro-batches on 8 GPUs,
# 24 on one. The world size must divide 1152 / 48 = 24 (1, 2, 3, 4, 6, 8, 12 or 24 GPUs); otherwise pick another
# --batch_size that divides 1152 / world size.
out_dir = "out/l12_bam_ssmax"
data_dir = "data/fineweb10B"   # python prepare_fineweb.py (gpt2 tokenizer)
model_size = "l12"             # 12 layers, n_embd 768, 16 heads of 48
