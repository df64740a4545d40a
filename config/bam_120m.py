# The paper's l12 ("120M") BAM+SSMax run, in the authors' setup:
#     python prepare_fineweb.py                                    # 11.9B mistral tokens -> data/fineweb_mistral
#     torchrun --standalone --nproc_per_node=8 train.py config/bam_120m.py
# The recipe itself (optimizer, schedule, 589,824 tokens per step, 20,000 steps, bf16, seed 42, ...) is train.py's
# defaults, the one place it is written down; this file only names the run, its data and the model size.
# Data as the authors build it: their Mistral v3 tokenizer (32,768 tokens; l12 has 121,130,496 parameters, the
# paper's 121.13M), every document BOS ... EOS with the document mask starting at BOS, validation = the first
# 3,932,160 tokens, then a 1,000,000-token gap, then training. The recipe reads 20,000 x 589,824 = 11.8B tokens,
# more than FineWeb sample-10BT (about 10B gpt2 tokens) provides, so prepare_fineweb.py takes them from
# sample-100BT and no token is read twice (train.py refuses to start a run that would repeat data;
# --allow_data_repeat=True permits it). What still differs from the authors' runs: their sample-10BT stream was
# shorter than the 11.8B tokens read, so part of it was read twice; this run reads fresh sample-100BT documents.
# gpt2 is one flag away (148.07M parameters with its 50,304 padded vocabulary):
#     python prepare_fineweb.py --tokenizer gpt2 && train.py config/bam_120m.py --data_dir=data/fineweb_gpt2
# Every other variant of the sweep uses the same recipe, e.g.
#     ... train.py config/bam_120m.py --pos_encoding=rope --ssmax=False --out_dir=out/l12_rope
# (pos_encoding: nope | sinusoidal | rope | alibi | bam; ssmax: True | False; other sizes: --model_size=l6 ... l24).
# batch_size 48 per GPU with gradient accumulation making up 1152 sequences per step: 3 micro-batches on 8 GPUs,
# 24 on one. The world size must divide 1152 / 48 = 24 (1, 2, 3, 4, 6, 8, 12 or 24 GPUs); otherwise pick another
# --batch_size that divides 1152 / world size.
out_dir = "out/l12_bam_ssmax"
data_dir = "data/fineweb_mistral"  # python prepare_fineweb.py (mistral tokenizer, sample-100BT, 11.9B tokens)
model_size = "l12"                 # 12 layers, n_embd 768, 16 heads of 48
