# The paper's l12 ("120M") BAM+SSMax run, in the authors' setup:
#     python prepare_fineweb.py           # 11.9B mistral tokens -> data/fineweb_mistral
#     torchrun --standalone --nproc_per_node=8 train.py config/bam_120m.py
# The recipe (optimizer, schedule, 589,824 tokens per step, 20,000 steps, bf16, seed 42, ...) is
# train.py's defaults; this file names the run, its data and the model size. The authors' data:
# their Mistral v3 tokenizer (l12 has 121,130,496 parameters, the paper's 121.13M), documents
# BOS ... EOS, validation = the first 3,932,160 tokens, a 1,000,000-token gap, then training. The
# recipe reads 11.8B tokens, more than FineWeb sample-10BT holds, so prepare_fineweb.py takes them
# from sample-100BT and no token is read twice (the authors' shorter stream was partly read twice).
# gpt2 is one flag away (148.07M parameters):
#     python prepare_fineweb.py --tokenizer gpt2
#     train.py config/bam_120m.py --data_dir=data/fineweb_gpt2
# Every variant of the sweep uses the same recipe, e.g. --pos_encoding=rope --ssmax=False
# --out_dir=out/l12_rope. batch_size 48 per GPU, 24 micro-batches in all making up 1152 sequences
# per step: the world size must divide 24. Another batch_size keeps the recipe with
# gradient_accumulation_steps = 1152 / batch_size.
out_dir = "out/l12_bam_ssmax"
# prepare_fineweb.py's default: mistral, sample-100BT, 11.9B tokens
data_dir = "data/fineweb_mistral"
# l12: the authors' configs' (n_layer, n_embd, n_head); their others: l6 (6, 512, 16), l8 (8, 768,
# 16), l15 (15, 1152, 24), l18 (18, 1536, 32), l24 (24, 2048, 64; config/bam_1b.py)
n_layer = 12
n_embd = 768
n_head = 16
