# The paper's l24 ("1.1B") BAM+SSMax run: train.py's defaults (the paper's recipe) on the l24 model
# (24 layers, n_embd 2048, 64 heads of 32), on the same data as config/bam_120m.py:
#     torchrun --standalone --nproc_per_node=8 train.py config/bam_1b.py
out_dir = "out/l24_bam_ssmax"
data_dir = "data/fineweb_mistral"
n_layer = 24
n_embd = 2048
n_head = 64
# batch_size 16 per 80 GB GPU (weights, grads and RAdam state take ~18 GB in fp32): 72
# micro-batches in all (9 each on 8 GPUs) for 1152 x 512 tokens per step; the world size divides 72
batch_size = 16
gradient_accumulation_steps = 72
eval_iters = 479  # 479 batches of 16 x 512 cover 99.8% of the 3,932,160-token val split
