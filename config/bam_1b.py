# The paper's l24 ("1.1B") BAM+SSMax run: train.py's defaults (the paper's recipe) on the l24 model (24 layers,
# n_embd 2048, 64 heads of 32).
#     torchrun --standalone --nproc_per_node=8 train.py config/bam_1b.py
# Every variant is reachable the same way: --pos_encoding=nope|sinusoidal|rope|alibi|bam --ssmax=True|False.
out_dir = "out/l24_bam_ssmax"
data_dir = "data/fineweb_mistral"  # python prepare_fineweb.py (enough for this run too: same tokens)
model_size = "l24"

# 589,824 tokens per step = 1152 x 512; batch_size 16 per 80 GB GPU (weights, grads and RAdam state alone take
# ~18 GB in fp32): 9 micro-batches on 8 GPUs. The world size must divide 1152 / 16 = 72.
batch_size = 16
# 479 batches of 16 x 512 cover 99.8% of the 3,932,160-token val split
eval_iters = 479
