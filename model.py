"""
The bam-gpt model: the paper's LLaMA-style decoder (as in the authors' models/) with one attention path and a
switch for the positional encoding, nope | sinusoidal | rope | alibi | bam, each with or without Scalable-Softmax.
sinusoidal is added to the token embeddings; rope rotates q and k (absolute positions, as the authors); alibi and
bam add a log-prior (priors.py) to the logits inside attention(). SSMax multiplies each query row's logits by
s_h * log(n_i), n_i = the keys visible to query i in its document. Also: size presets, optimizer groups, checkpoints.
"""
import os
import re
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import IMPLS as ATTN_IMPLS, attention, impl_error
from priors import PRIORS, BoundPrior, get_prior, ggd_mu

POS_ENCODINGS = ("nope", "sinusoidal", "rope", "alibi", "bam")

# (n_layer, n_embd, n_head) as in the authors' configs (ArthurSBianchessi/BAM); l12 is the paper's "120M", l24 "1.1B"
MODEL_SIZES = {"l6": (6, 512, 16), "l8": (8, 768, 16), "l12": (12, 768, 16), "l15": (15, 1152, 24),
               "l18": (18, 1536, 32), "l24": (24, 2048, 64)}


@dataclass
class GPTConfig:
    vocab_size: int = 50257          # the tokenizer's vocabulary; the embedding is padded to a multiple of 64
    n_layer: int = 12
    n_head: int = 16
    n_embd: int = 768
    block_size: int = 512            # the training context. Nothing at inference depends on it.
    pos_encoding: str = "bam"        # nope | sinusoidal | rope | alibi | bam
    ssmax: bool = True               # Scalable-Softmax: logits * s_h * log(n_i)
    ssmax_init: float = 1.0          # s starts at 1.0 in the authors' code (seq_scale)
    ssmax_prior: bool = True         # BAM+SSMax scales content AND prior, (l + B) * s log n (the authors' default);
                                     # attention() takes it as scale_prior
    prior: str = "ggd"               # the learned prior family of bam, a name registered in priors.py
    bam_init: str = "zero"           # its init spec (priors.py); ggd: zero (NoPE-equivalent) | alibi | linear | "A,B"
    train_mu: bool = False           # ggd: theta_mu is frozen at 0 in the paper (mu = 0)
    attn_impl: str = "auto"          # auto | torch | sdpa | triton (attention_kernel.py); no weights
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tokenizer: str = "gpt2"          # stored so that no script pairs a model with the wrong tokenizer

    def __post_init__(self):
        if self.pos_encoding not in POS_ENCODINGS:
            raise ValueError(f"pos_encoding must be one of {POS_ENCODINGS}, got {self.pos_encoding!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.pos_encoding == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.n_embd // self.n_head}")
        if self.attn_impl not in ATTN_IMPLS:  # unknown names only: what an impl can compute depends on the call
            raise ValueError(impl_error(self.attn_impl, None, "cpu", False))
        prior = get_prior(self.prior)  # an unregistered name fails here, naming the registered ones
        if self.pos_encoding == "bam":
            try:  # fail early on a malformed init string
                prior.init(self.bam_init, self.n_head)
            except ValueError as e:
                raise ValueError(f"bam_init {e} (the init of the prior {prior.name!r})") from None
        if self.train_mu and "theta_mu" not in prior.params:
            raise ValueError(f"train_mu=True, but the prior {prior.name!r} has no theta_mu")

    @property
    def padded_vocab_size(self):
        return -(-self.vocab_size // 64) * 64


# ----------------------------------------------------------------------------------------------------------
# Positions, from the position indices on every call (no tables): any length works, KV-cache decoding passes later
# positions. Angles in float64, so that position 500,000 keeps its phase (fp32 loses ~0.03 rad).
# ----------------------------------------------------------------------------------------------------------
def sinusoidal_embedding(pos, dim):
    """Vaswani et al.: PE[p, 2k] = sin(p / 10000^(2k/D)), PE[p, 2k+1] = cos(p / 10000^(2k/D)).
    The authors' code uses (2k+1)/D for the cosine; this is the standard form (README, "Where this repo departs")."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float64) / dim)
    ang = pos.double()[:, None] * inv_freq[None, :]
    pe = torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(1)  # interleave: sin, cos, sin, cos, ...
    return pe[:, :dim].float()


def rope_cos_sin(pos, head_dim, theta):
    """LLaMA RoPE angles for adjacent pairs (2k, 2k+1): frequency theta^(-2k/head_dim)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float64) / head_dim)
    ang = pos.double()[:, None] * inv_freq[None, :]
    return ang.cos().float(), ang.sin().float()  # (T, head_dim/2) each


def apply_rope(x, cos, sin):
    """Rotate adjacent pairs of x (B, H, T, D) by the angles (T, D/2)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


# ---- Blocks ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # in fp32, as the paper's backbone does
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class KVCache:
    """Keys and values of every layer for incremental decoding (prefill a prompt, then one token at a time), in
    buffers of `capacity` positions allocated once: no copy of the cache as it grows."""

    def __init__(self, n_layer, capacity):
        self.k, self.v, self.capacity = [None] * n_layer, [None] * n_layer, capacity
        self.length = 0  # positions already cached (GPT.forward advances it after all layers ran)

    def update(self, layer, k, v):
        """Append this step's k, v (B, H, T, D) and return views of everything cached so far."""
        end = self.length + k.shape[2]
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = (t.new_empty(*t.shape[:2], self.capacity, t.shape[3]) for t in (k, v))
        self.k[layer][:, :, self.length:end], self.v[layer][:, :, self.length:end] = k, v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.config, self.pos_encoding, self.ssmax_prior = cfg, cfg.pos_encoding, cfg.ssmax_prior
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.n_embd, cfg.n_embd, bias=False) for _ in range(4))
        # bam learns a prior per layer, a value of each parameter per head; alibi's fixed slopes are not saved
        self.prior_def = get_prior(cfg.prior if cfg.pos_encoding == "bam" else "alibi") \
            if cfg.pos_encoding in ("bam", "alibi") else None
        if self.prior_def is not None:
            trainable = set(self.prior_def.trainable) | ({"theta_mu"} if cfg.train_mu else set())
            for name, value in zip(self.prior_def.params, self.prior_def.init(cfg.bam_init, cfg.n_head)):
                if cfg.pos_encoding == "bam":
                    setattr(self, name, nn.Parameter(value, requires_grad=name in trainable))
                else:
                    self.register_buffer(name, value, persistent=False)
        if cfg.ssmax:
            self.ssmax_s = nn.Parameter(torch.full((cfg.n_head,), float(cfg.ssmax_init)))

    def prior(self):
        """This layer's prior with its parameters (a BoundPrior), or None without a positional prior."""
        return self.prior_def and BoundPrior(self.prior_def, tuple(getattr(self, n) for n in self.prior_def.params))

    def qkv(self, x, rope):
        """Queries, keys and values (B, H, T, D) of x (B, T, C), rotated if rope = (cos, sin) is given."""
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def attention_kwargs(self, doc_start, log_n):
        """The keyword arguments of attention() for this layer: doc_start, prior, row_scale, scale_prior."""
        row_scale = None
        if log_n is not None:  # SSMax: r_i = s_h * log n_i, shape (B or 1, H, T)
            row_scale = self.ssmax_s[None, :, None] * log_n[:, None, :]
        return dict(doc_start=doc_start, prior=self.prior(), row_scale=row_scale,
                    scale_prior=self.pos_encoding == "bam" and self.ssmax_prior)

    def forward(self, x, rope, doc_start, log_n, kv_cache):
        B, T, C = x.shape
        q, k, v = self.qkv(x, rope)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        y = attention(q, k, v, **self.attention_kwargs(doc_start, log_n), impl=self.config.attn_impl)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):  # SwiGLU, hidden 2*D (the authors' ffn_dim_multiplier 2)
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        D = cfg.n_embd
        self.w1, self.w3 = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False)
        self.w2 = nn.Linear(2 * D, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, doc_start, log_n, kv_cache):
        x = x + self.attn(self.attn_norm(x), rope, doc_start, log_n, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


# ---- The model -------------------------------------------------------------------------------------------
class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        V = cfg.padded_vocab_size
        self.wte = nn.Embedding(V, cfg.n_embd)  # PyTorch default init everywhere, as the authors: no custom init
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, V, bias=False)  # untied from wte

    def num_params(self, non_embedding=False):
        """Total parameters (trainable or not); non_embedding subtracts the input embedding (as the authors report)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None, *, doc_start=None, kv_cache=None, logits_at=None, reduction="mean"):
        """(logits, loss) of idx (B, T); doc_start (B, T): each token's document start (None = one document).
        logits_at: an int k keeps the last k positions' logits, or a 1-D tensor of positions. reduction="none": the
        loss per token (B, T), no logits, in chunks so that no (T x vocab) tensor exists (100K-token sequences)."""
        B, T = idx.shape
        cfg = self.config
        if kv_cache is not None and doc_start is not None:
            raise ValueError("doc_start is for training batches; a KV-cache prompt is one document")
        pos0 = kv_cache.length if kv_cache is not None else 0
        pos = torch.arange(pos0, pos0 + T, device=idx.device)
        x = self.wte(idx)
        if cfg.pos_encoding == "sinusoidal":
            x = x + sinusoidal_embedding(pos, cfg.n_embd).to(x.dtype)
        rope = rope_cos_sin(pos, cfg.n_embd // cfg.n_head, cfg.rope_theta) if cfg.pos_encoding == "rope" else None
        log_n = None
        if cfg.ssmax:  # n_i = keys visible to query i = position inside its document + 1 (as the authors' SSMax)
            n = (pos[None, :] - doc_start + 1) if doc_start is not None else (pos + 1)[None, :]
            log_n = n.float().log()
        for block in self.blocks:
            x = block(x, rope, doc_start, log_n, kv_cache)
        if kv_cache is not None:
            kv_cache.length += T
        x = self.norm(x)

        if targets is not None and reduction == "none":
            return None, self._token_losses(x, targets)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
            return logits, loss
        if logits_at is not None:
            x = x[:, -logits_at:] if isinstance(logits_at, int) else x[:, logits_at]
        return self.lm_head(x), None

    def _token_losses(self, x, targets, chunk_tokens=8192):
        losses = []
        for a in range(0, x.shape[1], chunk_tokens):
            logits = self.lm_head(x[:, a:a + chunk_tokens]).float()
            losses.append(F.cross_entropy(logits.transpose(1, 2), targets[:, a:a + chunk_tokens],
                                          ignore_index=-1, reduction="none"))
        return torch.cat(losses, dim=1)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, stop_tokens=(), temperature=0.0, top_k=None, stop=None):
        """Greedy (temperature 0) or sampled continuation (from the top_k most likely tokens, if given) with a KV
        cache. idx (1, T). stop(tokens so far) -> True ends it early (stop strings). Returns new tokens (list)."""
        cache = KVCache(self.config.n_layer, idx.shape[1] + max_new_tokens)
        logits, _ = self(idx, kv_cache=cache, logits_at=1)
        out = []
        for _ in range(max_new_tokens):
            logits = logits[:, -1, :self.config.vocab_size].float()  # the padded ids are no tokens
            if temperature > 0:
                if top_k is not None:  # keep the top_k logits (ties with the k-th included)
                    logits = logits.masked_fill(logits < logits.topk(min(top_k, logits.shape[-1])).values[:, -1:],
                                                float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            tok = int(nxt)
            out.append(tok)
            if tok in stop_tokens or (stop is not None and stop(out)):
                break
            logits, _ = self(nxt, kv_cache=cache)
        return out

    # ---- optimizer -------------------------------------------------------------------------------------
    def param_groups(self):
        """The four optimizer groups of the authors' train.py: weight-decayed matrices, norms, prior, SSMax."""
        groups = {"decay": [], "no_decay": [], "prior": [], "ssmax": []}
        prior_params = {id(p) for b in self.blocks if b.attn.prior_def is not None for p in b.attn.prior().params}
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if id(p) in prior_params:
                groups["prior"].append(p)
            elif name.endswith("ssmax_s"):
                groups["ssmax"].append(p)
            elif p.squeeze().dim() >= 2:
                groups["decay"].append(p)
            else:
                groups["no_decay"].append(p)
        return groups

    def configure_optimizers(self, weight_decay, learning_rate, betas, prior_lr=None, ssmax_lr=None):
        """RAdam, decoupled weight decay on >= 2-D weights (as the authors); train.py schedules each group's base_lr."""
        g = self.param_groups()
        spec = [(g["decay"], weight_decay, learning_rate), (g["no_decay"], 0.0, learning_rate),
                (g["prior"], 0.0, prior_lr or learning_rate), (g["ssmax"], 0.0, ssmax_lr or learning_rate)]
        groups = [{"params": ps, "weight_decay": wd, "lr": lr, "base_lr": lr} for ps, wd, lr in spec if ps]
        return torch.optim.RAdam(groups, lr=learning_rate, betas=betas, decoupled_weight_decay=True)

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 L T D (causal halving ignored)."""
        cfg = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * seq_len

    # ---- inspection --------------------------------------------------------------------------------------
    @torch.no_grad()
    def prior_summary(self):
        """Per layer with a prior or SSMax: the prior's name, its parameters per head (ggd also mu), SSMax's s."""
        rows = []
        for i, attn in enumerate(block.attn for block in self.blocks):
            row, prior = {"layer": i}, attn.prior()
            if prior is not None:
                row["prior"] = prior.prior.name
                row.update({n: t.float().tolist() for n, t in zip(prior.prior.params, prior.params)})
                if prior.prior.name == "ggd":
                    row["mu"] = ggd_mu(attn.theta_mu.float()).tolist()
            if hasattr(attn, "ssmax_s"):
                row["ssmax_s"] = attn.ssmax_s.float().tolist()
            rows += [row] if len(row) > 1 else []
        return rows


# ---- Precision and the GPU's peak: one home for train.py, bench.py and the evaluations -------------------
def autocast(device, dtype):
    """The autocast context of a precision name (bfloat16 | float16 | float32); float32 runs without autocast."""
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=getattr(torch, dtype))


# bf16 dense tensor-core peak per GPU, matched against torch.cuda.get_device_name() in this order (for MFU)
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12), ("H100", 989.5e12),
                   ("H200", 989.5e12), ("GH200", 989.5e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12),
                   ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("A6000", 154.8e12), ("A10G", 70e12),
                   ("A10", 125e12), ("RTX 4090", 165.2e12), ("RTX 3090", 71e12)]


def peak_flops(device_name):
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in device_name), None)


# ----------------------------------------------------------------------------------------------------------
# Checkpoints, the one place that writes and reads them: a dict of "model_args" (the GPTConfig as a dict),
# "model" (a clean state_dict) and whatever the trainer adds (optimizer, step, RNG, ...).
# ----------------------------------------------------------------------------------------------------------
CKPT_RE = re.compile(r"ckpt_(\d+)\.pt$")
RUNTIME_KEYS = ("attn_impl",)  # how to compute, not what: the caller's choice, never the checkpoint's


class CheckpointError(RuntimeError):
    """A file that is not a readable bam-gpt checkpoint, or one that does not fit the model asked for."""


def unwrap(model):
    """The plain GPT inside a DDP and/or torch.compile wrapper (DDP(compile(model)), as train.py builds it)."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def save_checkpoint(path, model, **extra):
    """Atomic: write to a temporary file in the same directory, then rename over the target."""
    raw = unwrap(model)  # saved keys carry no "_orig_mod." / "module." prefixes
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({"model_args": asdict(raw.config), "model": raw.state_dict(), **extra}, tmp)
    os.replace(tmp, path)


def checkpoint_name(step):
    return f"ckpt_{step:07d}.pt"


def checkpoints(run_dir):
    """[(step, path)] of the checkpoints in a run directory, oldest first ([] if there is no such directory)."""
    if not os.path.isdir(run_dir):
        return []
    return sorted((int(m.group(1)), os.path.join(run_dir, f)) for f in os.listdir(run_dir) if (m := CKPT_RE.match(f)))


def load_checkpoint(path, map_location="cpu"):
    """The checkpoint dict of a .pt file or a run directory's newest ckpt_<step>.pt, loaded with weights_only=True."""
    if os.path.isdir(path):
        if not (found := checkpoints(path)):
            raise FileNotFoundError(f"run directory {path!r} holds no ckpt_<step>.pt; has train.py saved one yet?")
        path = found[-1][1]
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}: pass a .pt file or a run directory written by train.py")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"could not read checkpoint {path!r} ({type(e).__name__}: {e}); "
                              "is it a bam-gpt checkpoint and fully written?") from e
    if not isinstance(ckpt, dict) or "model_args" not in ckpt or "model" not in ckpt:
        raise CheckpointError(f"{path!r} is not a bam-gpt checkpoint (expected keys 'model_args' and 'model')")
    return dict(ckpt, path=path)


def checkpoint_model_args(ckpt):
    """A checkpoint's GPTConfig as a dict, settings it predates and RUNTIME_KEYS at their defaults; CheckpointError
    for settings this code does not know and for an unregistered prior."""
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    if unknown := set(ckpt["model_args"]) - set(defaults):
        raise CheckpointError(f"checkpoint {ckpt.get('path', '')!r} has model settings this code does not know: "
                              f"{sorted(unknown)}")
    args = {**defaults, **{k: v for k, v in ckpt["model_args"].items() if k not in RUNTIME_KEYS}}
    if args["pos_encoding"] == "bam" and args["prior"] not in PRIORS:
        raise CheckpointError(f"checkpoint {ckpt.get('path', '')!r} uses the prior {args['prior']!r}, which is not "
                              f"registered (registered: {', '.join(PRIORS)}); register it in priors.py to load it")
    return args


def load_state(model, ckpt):
    """Load ckpt["model"] into model, or raise an error that says how the checkpoint's model differs."""
    raw, theirs = unwrap(model), checkpoint_model_args(ckpt)
    ours = asdict(raw.config)
    diff = [f"{k}: {theirs[k]!r} vs {ours[k]!r}" for k in ours if k not in RUNTIME_KEYS and theirs[k] != ours[k]]
    if diff:
        raise ValueError(f"checkpoint {ckpt.get('path', '')!r} is from another model (checkpoint vs this model):\n  "
                         + "\n  ".join(diff))
    try:
        raw.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # missing or unexpected keys, other shapes
        raise CheckpointError(f"checkpoint {ckpt.get('path', '')!r} does not fit this model: "
                              + " ".join(str(e).split())) from None


def load_model(path, device="cpu", attn_impl="auto"):
    """(GPT in eval mode, checkpoint dict) from a checkpoint file or run directory, attention computed by attn_impl."""
    ckpt = load_checkpoint(path)
    model = GPT(GPTConfig(**dict(checkpoint_model_args(ckpt), attn_impl=attn_impl or "auto")))
    load_state(model, ckpt)
    return model.to(device).eval(), ckpt
