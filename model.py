"""
bam-gpt's model: the paper's LLaMA-style decoder (as the authors' models/), one attention path, a
positional encoding switch nope | sinusoidal | rope | alibi | bam, each with or without
Scalable-Softmax. sinusoidal adds to the token embeddings; rope rotates q and k (absolute
positions, as the authors); alibi and bam add a log-prior (priors.py) to the logits in attention().
SSMax multiplies query row i's logits by s_h * log(n_i), n_i the keys i sees in its document.
Also: size presets, optimizer groups, and the checkpoint format.
"""

import os
import re
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import IMPLS, attention, impl_error, prior_gap, ssmax_log_n
from priors import BoundPrior, get_prior

POS_ENCODINGS = ("nope", "sinusoidal", "rope", "alibi", "bam")

# SSMax's s starts at 1 per head, as the authors' code (seq_scale)
SSMAX_INIT = 1.0


@dataclass
class GPTConfig:
    """The model's settings, declared once: train.py takes each field (but vocab_size and
    tokenizer, from the data) as a setting with this default."""

    vocab_size: int = 50257  # the tokenizer's; embedding padded to a multiple of 64
    n_layer: int = 12
    n_head: int = 16
    n_embd: int = 768
    block_size: int = 512  # training context; nothing at inference depends on it
    pos_encoding: str = "bam"  # nope | sinusoidal | rope | alibi | bam
    ssmax: bool = True  # Scalable-Softmax: query row i's logits times s_h * log(n_i)
    # bam + ssmax: s log n scales content score AND log-prior (paper's placement) for a trained
    # prior; a fixed prior keeps the scale it was designed for
    scale_prior: bool = True
    # bam's learned prior, named in priors.py: ggd | cauchy | kerple_log | t5_bucket | ...
    prior: str = "ggd"
    # the prior's init (priors.py); ggd: zero (starts as NoPE) | alibi | linear | "A,B";
    # default: the prior's own (its paper's, if any)
    bam_init: str = "zero"
    train_mu: bool = False  # ggd: train theta_mu too (the paper freezes it at 0, mu = 0)
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tokenizer: str = "gpt2"  # stored so no script pairs a model with the wrong tokenizer

    def __post_init__(self):
        if self.pos_encoding not in POS_ENCODINGS:
            raise ValueError(
                f"pos_encoding must be one of {POS_ENCODINGS}, got {self.pos_encoding!r}"
            )
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.pos_encoding == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.n_embd // self.n_head}")

        # an unregistered name fails here, listing the known ones
        family = get_prior(self.prior)
        if self.train_mu and "theta_mu" not in family.params:
            raise ValueError(f"train_mu=True, but the prior {family.name!r} has no theta_mu")
        if self.pos_encoding == "bam":
            try:  # a malformed init string, leaving the seeded RNG alone
                with torch.random.fork_rng(devices=[]):
                    family.initial(self.bam_init, self.n_head)
            except ValueError as e:
                raise ValueError(
                    f"bam_init {e} (the init of the prior {family.name!r}; 'default' is its own, "
                    f"{family.default_init!r})"
                ) from None

        # a non-default setting this model does not use is an error: rope with --prior=kerple_log
        # would otherwise train with the prior silently unused
        bam = self.pos_encoding == "bam"
        used = dict(
            prior=bam,
            bam_init=bam,
            train_mu=bam,
            scale_prior=bam and self.ssmax and bool(family.trainable),
            rope_theta=self.pos_encoding == "rope",
        )
        defaults = {f.name: f.default for f in fields(self)}
        for name, is_used in used.items():
            value = getattr(self, name)
            if not is_used and value != defaults[name]:
                raise ValueError(
                    f"{name}={value!r} has no effect on this model (pos_encoding="
                    f"{self.pos_encoding}, ssmax={self.ssmax}, prior={self.prior}); drop it"
                )

    @property
    def family(self):
        """The registered Prior this encoding adds to the logits: bam's learned one (`prior`),
        alibi's fixed slopes, or None for encodings without one."""
        if self.pos_encoding == "bam":
            return get_prior(self.prior)
        if self.pos_encoding == "alibi":
            return get_prior("alibi")
        return None

    @property
    def padded_vocab_size(self):
        return -(-self.vocab_size // 64) * 64


# ---- Positions
# From position indices per call (no tables): any length works; KV-cache decoding passes later
# positions. float64 angles keep position 500,000's phase (fp32 loses ~0.03 rad).
def angles(pos, dim, base):
    """(T, dim / 2) float64: position p times frequency base^(-2k/dim), k = 0 .. dim / 2 - 1."""
    exponents = torch.arange(0, dim, 2, device=pos.device, dtype=torch.float64) / dim
    return pos.double()[:, None] * base ** (-exponents)[None, :]


def sinusoidal_embedding(pos, dim):
    """Vaswani et al.: PE[p, 2k] = sin(p / 10000^(2k/D)), PE[p, 2k+1] = cos(p / 10000^(2k/D)). The
    authors' cosine uses (2k+1)/D; this is the standard (README, "Where this repo departs")."""
    phase = angles(pos, dim, 10000.0)
    # interleaved: sin, cos, sin, cos, ...
    pe = torch.stack([phase.sin(), phase.cos()], dim=-1).flatten(1)
    return pe[:, :dim].float()


def apply_rope(x, cos, sin):
    """Rotate adjacent pairs of x (B, T, H, D) by angles (T, 1, D/2)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return rotated.to(x.dtype)


# ---- Blocks
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # fp32, as the paper's backbone
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class KVCache:
    """Every layer's keys and values for incremental decoding (prefill, then a token at a time), in
    buffers of `capacity` positions allocated once: no copy as the cache grows. A buffer is laid
    out (B, capacity, H, D), as the projections are, and read as (B, H, T, D) views. It keeps what
    a skipping step's windows need that decoding does not change, so that a step reads only its
    window: each layer's largest key norm (B, H), and its prior's gap table to the capacity."""

    def __init__(self, n_layer, capacity):
        self.k = [None] * n_layer
        self.v = [None] * n_layer
        self.key_norm = [None] * n_layer
        self.prior_gap = [None] * n_layer
        self.capacity = capacity
        self.length = 0  # positions cached (GPT.forward advances it after all layers)

    def update(self, layer, k, v, prior):
        """Append k, v (B, H, T, D); return views of all cached so far, the largest key norm and
        the gap table of the layer's prior (a BoundPrior or None), built at the prefill."""
        if self.k[layer] is None:
            batch, heads, _, head_dim = k.shape
            self.k[layer] = k.new_empty(batch, self.capacity, heads, head_dim)
            self.v[layer] = v.new_empty(batch, self.capacity, heads, head_dim)
            self.key_norm[layer] = k.new_zeros(batch, heads, dtype=torch.float32)
            if prior is not None:
                self.prior_gap[layer] = prior_gap(prior, self.capacity, k.device)

        end = self.length + k.shape[2]
        self.k[layer][:, self.length : end] = k.transpose(1, 2)
        self.v[layer][:, self.length : end] = v.transpose(1, 2)
        norm = k.float().norm(dim=-1).amax(-1)
        self.key_norm[layer] = torch.maximum(self.key_norm[layer], norm)
        keys = self.k[layer][:, :end].transpose(1, 2)
        values = self.v[layer][:, :end].transpose(1, 2)
        return keys, values, self.key_norm[layer], self.prior_gap[layer]


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int, attn_impl: str, skip: bool = True):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.attn_impl = attn_impl
        self.skip = skip
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

        # bam learns a prior per layer, each param per head; alibi's fixed slopes are buffers, not
        # saved (they follow from n_head)
        self.family = cfg.family
        if self.family is not None:
            trainable = set(self.family.trainable)
            if cfg.train_mu:
                trainable.add("theta_mu")
            values = self.family.initial(cfg.bam_init, cfg.n_head)
            for name, value in zip(self.family.params, values):
                if cfg.pos_encoding == "bam":
                    setattr(self, name, nn.Parameter(value, requires_grad=name in trainable))
                else:
                    self.register_buffer(name, value, persistent=False)

        self.ssmax_s = nn.Parameter(torch.full((cfg.n_head,), SSMAX_INIT)) if cfg.ssmax else None
        # bam + SSMax scales a trained prior too; a fixed one keeps its designed scale
        trained = self.family is not None and bool(self.family.trainable)
        self.scale_prior = cfg.pos_encoding == "bam" and cfg.ssmax and cfg.scale_prior and trained

    def bound_prior(self):
        """This layer's prior with its params (a BoundPrior), or None."""
        if self.family is None:
            return None

        params = tuple(getattr(self, name) for name in self.family.params)
        return BoundPrior(self.family, params)

    def forward(self, x, rope, doc_start, log_n, kv_cache):
        batch, seq_len, n_embd = x.shape
        # (B, T, H, D), rotated in that layout, then seen as (B, H, T, D): what the kernel reads
        q, k, v = (
            w(x).view(batch, seq_len, self.n_head, self.head_dim)
            for w in (self.wq, self.wk, self.wv)
        )
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        prior = self.bound_prior()
        key_norm = None
        gap = None
        if kv_cache is not None:
            k, v, key_norm, gap = kv_cache.update(self.layer_idx, k, v, prior)

        # SSMax: r_i = s_h * log n_i, shape (B or 1, H, T)
        row_scale = None
        if self.ssmax_s is not None:
            row_scale = self.ssmax_s[None, :, None] * log_n[:, None, :]

        y = attention(
            q,
            k,
            v,
            doc_start=doc_start,
            prior=prior,
            row_scale=row_scale,
            scale_prior=self.scale_prior,
            impl=self.attn_impl,
            skip=self.skip,
            key_norm=key_norm,
            prior_gap=gap,
        )
        return self.wo(y.transpose(1, 2).reshape(batch, seq_len, n_embd))


class MLP(nn.Module):  # SwiGLU, hidden 2*D (authors' ffn_dim_multiplier 2)
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        D = cfg.n_embd
        self.w1 = nn.Linear(D, 2 * D, bias=False)
        self.w3 = nn.Linear(D, 2 * D, bias=False)
        self.w2 = nn.Linear(2 * D, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int, attn_impl: str, skip: bool):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg, layer_idx, attn_impl, skip)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, doc_start, log_n, kv_cache):
        x = x + self.attn(self.attn_norm(x), rope, doc_start, log_n, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


# ---- The model
class GPT(nn.Module):
    """A GPTConfig's model. attn_impl and skip (attention()'s impl and skip) are runtime choices:
    they change no weight, so they are not in the config; a checkpoint loads under any."""

    def __init__(self, cfg: GPTConfig, attn_impl: str = "auto", skip: bool = True):
        super().__init__()
        if attn_impl not in IMPLS:
            raise ValueError(impl_error(attn_impl, None, "cpu", False))

        self.config = cfg
        V = cfg.padded_vocab_size
        # PyTorch's default init everywhere, as the authors
        self.wte = nn.Embedding(V, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg, i, attn_impl, skip) for i in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, V, bias=False)  # untied from wte

    def num_params(self, non_embedding=False):
        """Total params (trainable or not); non_embedding drops the input embedding (as the
        authors report)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if non_embedding else n

    def forward(
        self, idx, targets=None, *, doc_start=None, kv_cache=None, logits_at=None, reduction="mean"
    ):
        """(logits, loss) of idx (B, T); doc_start (B, T): each token's document start (None: one
        document). logits_at: int k keeps the last k positions' logits, or a 1-D tensor of
        positions. reduction="none": loss per token (B, T), no logits, chunked so no (T x vocab)
        tensor exists (100K-token sequences)."""
        cfg = self.config
        seq_len = idx.shape[1]
        if kv_cache is not None and doc_start is not None:
            raise ValueError("doc_start is for training batches; a KV-cache prompt is one document")

        first = kv_cache.length if kv_cache is not None else 0
        pos = torch.arange(first, first + seq_len, device=idx.device)
        x = self.wte(idx)
        if cfg.pos_encoding == "sinusoidal":
            x = x + sinusoidal_embedding(pos, cfg.n_embd).to(x.dtype)

        rope = None
        if cfg.pos_encoding == "rope":  # LLaMA's angles of pairs (2k, 2k+1), the same every head
            phase = angles(pos, cfg.n_embd // cfg.n_head, cfg.rope_theta)[:, None]
            rope = phase.cos().float(), phase.sin().float()
        log_n = ssmax_log_n(pos, doc_start) if cfg.ssmax else None

        for block in self.blocks:
            x = block(x, rope, doc_start, log_n, kv_cache)
        if kv_cache is not None:
            kv_cache.length += seq_len

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
        for xs, ts in zip(x.split(chunk_tokens, dim=1), targets.split(chunk_tokens, dim=1)):
            logits = self.lm_head(xs).float().transpose(1, 2)
            losses.append(F.cross_entropy(logits, ts, ignore_index=-1, reduction="none"))
        return torch.cat(losses, dim=1)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, stop_tokens=(), temperature=0.0, top_k=None, stop=None):
        """Greedy (temperature 0) or sampled continuation (from the top_k tokens, if given) with a
        KV cache. idx (1, T). stop(tokens so far) -> True ends early (stop strings). Returns the
        new tokens (a list)."""
        cache = KVCache(self.config.n_layer, idx.shape[1] + max_new_tokens)
        logits, _ = self(idx, kv_cache=cache, logits_at=1)

        new_tokens = []
        for _ in range(max_new_tokens):
            logits = logits[:, -1, : self.config.vocab_size].float()  # padded ids are no tokens
            if temperature > 0:
                if top_k is not None:  # keep the top_k (ties with the k-th too)
                    kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(torch.softmax(logits / temperature, -1), 1)
            else:
                next_id = logits.argmax(-1, keepdim=True)

            token = int(next_id)
            new_tokens.append(token)
            done = len(new_tokens) == max_new_tokens or token in stop_tokens
            if done or (stop is not None and stop(new_tokens)):
                break
            logits, _ = self(next_id, kv_cache=cache)
        return new_tokens

    # ---- optimizer
    def param_groups(self):
        """The authors' train.py's four optimizer groups: decayed matrices, norms, prior, SSMax."""
        groups = {"decay": [], "no_decay": [], "prior": [], "ssmax": []}
        prior_params = set()
        for block in self.blocks:
            if block.attn.family is not None:
                prior_params |= {id(p) for p in block.attn.bound_prior().params}

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

    def configure_optimizers(self, weight_decay, learning_rate, betas, prior_lr=0, ssmax_lr=0):
        """RAdam, decoupled weight decay on >= 2-D weights (as the authors); the prior's and
        SSMax's rates default (0) to learning_rate; train.py schedules each group's base_lr."""
        rates = dict(prior=prior_lr, ssmax=ssmax_lr)
        groups = []
        for name, params in self.param_groups().items():
            lr = rates.get(name) or learning_rate
            decay = weight_decay if name == "decay" else 0.0
            if params:
                groups.append(dict(params=params, weight_decay=decay, lr=lr, base_lr=lr))
        return torch.optim.RAdam(groups, lr=learning_rate, betas=betas, decoupled_weight_decay=True)

    def flops_per_token(self, seq_len):
        """Training FLOPs/token (fwd + bwd), PaLM appendix B: 6N + 12 L T D (no causal halving)."""
        cfg = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * seq_len

    @torch.no_grad()
    def prior_record(self):
        """The learned prior's shape param per layer, [min, median, max] over heads, and how many
        heads its highlight rule picks (ggd: theta_beta < 0); {} without one."""
        family = self.config.family
        if self.config.pos_encoding != "bam":
            return {}

        record = {family.shape_param: []}
        for block in self.blocks:
            shape = getattr(block.attn, family.shape_param).float().cpu()
            quantiles = [shape.min(), shape.quantile(0.5), shape.max()]
            record[family.shape_param].append([round(q.item(), 4) for q in quantiles])
        if family.highlight is not None:
            picked = [family.highlight(*block.attn.bound_prior().params) for block in self.blocks]
            record["heads_highlighted"] = int(sum(p.sum() for p in picked))
        return record


# ---- Checkpoints
# A checkpoint is a dict: "model_args" (the GPTConfig), "model" (the state_dict) and what train.py
# adds (optimizer, step, RNG, ...). It is read with weights_only=True, so that reading one never
# runs code; infra/runtime.save_checkpoint writes one whole or not at all. A run directory holds
# ckpt_<step>.pt files.
CHECKPOINT_RE = re.compile(r"ckpt_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A file that is not a readable bam-gpt checkpoint, one that does not fit the model asked for,
    or a checkpoint that could not be written."""


def checkpoint_name(step):
    return f"ckpt_{step:07d}.pt"


def checkpoints(run_dir):
    """[(step, path)] of a run directory's checkpoints, oldest first ([] without the directory)."""
    names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
    matches = [CHECKPOINT_RE.match(name) for name in names]
    return sorted((int(m.group(1)), os.path.join(run_dir, m.group(0))) for m in matches if m)


def checkpoint_state(model, **extra):
    """What a checkpoint of model (a plain GPT) holds, with train.py's `extra`."""
    return {"model_args": asdict(model.config), "model": model.state_dict(), **extra}


def load_checkpoint(path):
    """The checkpoint dict of a .pt file, or of a run directory's newest checkpoint, on the CPU.
    Its "path" says which file it was."""
    if os.path.isdir(path):
        found = checkpoints(path)
        if not found:
            raise FileNotFoundError(
                f"run directory {path!r} holds no ckpt_<step>.pt; has train.py saved one yet?"
            )
        path = found[-1][1]
    elif not os.path.isfile(path):
        raise FileNotFoundError(
            f"no checkpoint at {path!r}: pass a .pt file or a run directory written by train.py"
        )

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"could not read checkpoint {path!r} ({type(e).__name__}: {e}); "
            "is it a bam-gpt checkpoint and fully written?"
        ) from e

    if not isinstance(ckpt, dict) or "model_args" not in ckpt or "model" not in ckpt:
        raise CheckpointError(
            f"{path!r} is not a bam-gpt checkpoint (expected keys 'model_args' and 'model')"
        )
    return dict(ckpt, path=path)


def checkpoint_config(ckpt):
    """A checkpoint's GPTConfig; CheckpointError if its settings are not this code's."""
    where = ckpt["path"]
    saved = ckpt["model_args"]
    names = {f.name for f in fields(GPTConfig)}
    if set(saved) != names:
        raise CheckpointError(
            f"checkpoint {where!r} has other model settings than this code: unknown "
            f"{sorted(set(saved) - names)}, missing {sorted(names - set(saved))}"
        )
    try:
        return GPTConfig(**saved)
    except ValueError as e:  # a prior not registered in priors.py, among others
        raise CheckpointError(f"checkpoint {where!r} makes no model of this code: {e}") from None


def load_state(model, ckpt):
    """Load ckpt["model"] into model (a plain GPT); a ValueError says how models differ."""
    where = ckpt["path"]
    theirs = asdict(checkpoint_config(ckpt))
    ours = asdict(model.config)
    diff = [f"{k}: {theirs[k]!r} vs {ours[k]!r}" for k in ours if theirs[k] != ours[k]]
    if diff:
        raise ValueError(
            f"checkpoint {where!r} is from another model (checkpoint vs this model):\n  "
            + "\n  ".join(diff)
        )

    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # missing/unexpected keys, other shapes
        message = " ".join(str(e).split())
        raise CheckpointError(f"checkpoint {where!r} does not fit this model: {message}") from None


def load_model(path, device="cpu", attn_impl="auto", skip=True):
    """(GPT in eval mode, checkpoint dict) of a checkpoint file or run directory."""
    ckpt = load_checkpoint(path)
    model = GPT(checkpoint_config(ckpt), attn_impl, skip)
    load_state(model, ckpt)
    return model.to(device).eval(), ckpt
