"""
bam-gpt's positional priors: what a prior is, and those shipped. Add your own here.

A prior is a log-prior B_h(d) of signed distance d = j - i (query i, key j), one curve per head h,
added to the attention logits. A `Prior` (registered family) is a function of d and its params plus
a record (below); a `BoundPrior` binds it to one layer's params: attention()'s `prior`. Shipped: ggd
(the paper's), alibi, cauchy, published biases kerple_log, kerple_power, t5_bucket, sandwich, mlp.
"""

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

# Floor of every log-prior, in nats: BoundPrior.table clamps B(d) there (zero derivative below) so
# all impls compute the same bounded scores. If a row sees a key > ~104 nats above the floor, a
# floored score's exp() is 0 in fp32, clamped or not; a row with one visible key has P = 1 anyway.
# So the floor matters only if all keys a row sees lie within ~104 / r nats of it (r: SSMax's row
# scale). It removes log-priors like GGD's -3e7 at d = mu (theta_beta < 0): fp32 scores that lose
# the content, derivatives (1e20+) that turn rounding noise into gradients or overflow to inf.
LOG_PRIOR_FLOOR = -1e4


@dataclass(frozen=True)
class Prior:
    """A registered family of log-priors, under its name (GPTConfig.prior):
        fn(d, *params) -> (H, len(d)) float32   log-prior at 1-D distances d (d <= 0 seen)
        params, init(spec, H), trainable        param names, bam_init values, trained ones
    A param's first dim is the head: (H,) a value per head (GGD's theta_beta), (H, n) a vector
    (T5's buckets); head h's curve uses row h only. A param in `shared` has any shape and serves all
    heads (the MLP's hidden layer). A prior uses d and params only (not query position, as FIRE's
    normalisation, nor content): every impl builds one table by distance. For figures/logs: formula,
    shape_param (labels a head; default: first trainable), highlight(*params) -> (H,) bool and its
    highlight_label."""

    name: str
    fn: Callable
    params: tuple
    init: Callable
    trainable: tuple
    formula: str = ""
    shape_param: str = ""
    highlight: Optional[Callable] = None
    highlight_label: str = ""
    shared: tuple = ()
    default_init: str = "zero"

    def initial(self, spec, n_head):
        """Initial params for an init spec (bam_init); "default" is default_init."""
        return self.init(self.default_init if spec == "default" else spec, n_head)

    # figure fields' defaults: the five required fields make a full prior
    def __post_init__(self):
        if not self.formula:
            formula = f"B(d) = {self.fn.__name__}(d, {', '.join(self.params)})"
            object.__setattr__(self, "formula", formula)

        if not self.shape_param:
            candidates = tuple(self.trainable) + tuple(self.params) + ("",)
            object.__setattr__(self, "shape_param", candidates[0])


class BoundPrior(NamedTuple):
    """A registered family with one layer's params: attention()'s `prior`."""

    family: Prior
    params: tuple

    def table(self, d):
        """Log-prior at 1-D distances d, floored at LOG_PRIOR_FLOOR: (H, len(d)) float32."""
        return self.family.fn(d, *self.params).clamp_min(LOG_PRIOR_FLOOR)


PRIORS = {}


def register(family):
    """Register a Prior under family.name; return it."""
    if PRIORS.get(family.name, family) is not family:
        raise ValueError(f"a different prior is already registered as {family.name!r}")

    named = set(family.trainable) | {family.shape_param} | set(family.shared)
    if not named <= set(family.params):
        raise ValueError(
            f"prior {family.name!r}: trainable {family.trainable}, shape_param "
            f"{family.shape_param!r} and shared {family.shared} must be among its params "
            f"{family.params}"
        )

    PRIORS[family.name] = family
    return family


def get_prior(name):
    """The prior registered as `name` (a ValueError lists the registered ones)."""
    if name not in PRIORS:
        raise ValueError(f"unknown prior {name!r}; registered priors: {', '.join(PRIORS)}")
    return PRIORS[name]


def bind(prior):
    """attention()'s `prior` as a BoundPrior: None stays None; a 3-tuple of (H,) tensors is GGD."""
    if prior is None or isinstance(prior, BoundPrior):
        return prior

    is_triple = isinstance(prior, (tuple, list)) and len(prior) == 3
    if is_triple and all(torch.is_tensor(t) for t in prior):
        return BoundPrior(PRIORS["ggd"], tuple(prior))
    raise TypeError(
        "prior must be None, a BoundPrior, or a GGD triple (theta_alpha, theta_beta, theta_mu) of "
        f"(H,) tensors; got {type(prior).__name__}"
    )


def _per_head(*params):
    # (H,) params as (H, 1) columns
    return (t.float()[:, None] for t in params)


def _two_floats(spec, n_head, names, options):
    """Init spec "A,B" as two (H,) tensors: every head at A, and at B."""
    try:
        first, second = (float(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"must be {options} or '{names}' (two floats), got {spec!r}") from None

    return torch.full((n_head,), first), torch.full((n_head,), second)


# ---- GGD
# keeps (|d - mu| + eps)^theta_beta finite at d = mu for theta_beta < 0 (authors' value)
GGD_EPS = 1e-5


def ggd_mu(theta_mu):
    """Centre mu = 2 sinh(theta_mu) = exp(theta_mu) - exp(-theta_mu): odd and unbounded."""
    return 2.0 * torch.sinh(theta_mu)


def ggd_prior(d, theta_alpha, theta_beta, theta_mu):
    """GGD-BAM: B_h(d) = -exp(theta_alpha_h) * (|d - mu_h| + eps)^theta_beta_h, a generalised
    Gaussian log-density: theta_beta = 1 is Laplace (ALiBi), 0 flat (NoPE), < 0 favours far keys."""
    d = d.float()[None, :]
    alpha, beta, mu_raw = _per_head(theta_alpha, theta_beta, theta_mu)
    return -torch.exp(alpha) * torch.pow((d - ggd_mu(mu_raw)).abs() + GGD_EPS, beta)


def ggd_init(spec, n_head):
    """'zero' (authors' default: flat, BAM starts as NoPE), 'alibi', 'linear' (theta_beta over
    [0, 1] across heads) or 'A,B' (theta_alpha=A, theta_beta=B per head); theta_mu starts at 0."""
    theta_mu = torch.zeros(n_head)

    if spec == "zero":
        return torch.zeros(n_head), torch.zeros(n_head), theta_mu
    # exp(theta_alpha) = slope, theta_beta = 1: ALiBi's -m|d|
    if spec == "alibi":
        return alibi_slopes(n_head).log(), torch.ones(n_head), theta_mu
    if spec == "linear":
        return torch.zeros(n_head), torch.linspace(0.0, 1.0, n_head), theta_mu

    theta_alpha, theta_beta = _two_floats(spec, n_head, "ALPHA,BETA", "'zero', 'alibi', 'linear'")
    return theta_alpha, theta_beta, theta_mu


register(
    Prior(
        name="ggd",
        fn=ggd_prior,
        params=("theta_alpha", "theta_beta", "theta_mu"),
        init=ggd_init,
        trainable=("theta_alpha", "theta_beta"),
        formula="B(d) = -exp(θα)(|d - μ| + 1e-5)^θβ, μ = 2 sinh(θμ)",
        shape_param="theta_beta",
        highlight=lambda theta_alpha, theta_beta, theta_mu: theta_beta < 0,
        highlight_label="θβ < 0",
    )
)


# ---- ALiBi
def alibi_slopes(n_head):
    """ALiBi's per-head slopes (Press et al.). If n_head is no power of two (as ALiBi's code):
    the slopes of the power of two below, then every other one of the power above."""

    # 2^(-8/n), 2^(-16/n), ..., 2^(-8)
    def geometric(n):
        return [2.0 ** (-8.0 * (k + 1) / n) for k in range(n)]

    below = 2 ** int(math.floor(math.log2(n_head)))
    extra = geometric(2 * below)[0::2][: n_head - below]
    return torch.tensor(geometric(below) + extra, dtype=torch.float32)


def alibi_prior(d, slope):
    """ALiBi (Press et al.): B_h(d) = -m_h |d|, Laplace centred on the query (paper's Lemma 2)."""
    (m,) = _per_head(slope)
    return -m * d.float().abs()[None, :]


register(
    Prior(
        name="alibi",
        fn=alibi_prior,
        params=("slope",),
        trainable=(),
        init=lambda spec, n_head: (alibi_slopes(n_head),),
        formula="B(d) = -m|d|, fixed slopes m",
    )
)


# ---- Cauchy
def cauchy_prior(d, theta_a, theta_s):
    """B_h(d) = -theta_a_h log(1 + (d / exp(theta_s_h))^2), heavy-tailed (README, "Try your own
    prior"): theta_a = 1 is Cauchy of scale exp(theta_s), > 0 Student-t (power-law tail), 0 flat
    (NoPE), < 0 favours far keys."""
    power, log_scale = _per_head(theta_a, theta_s)
    return -power * torch.log1p((d.float()[None, :] / torch.exp(log_scale)) ** 2)


def cauchy_init(spec, n_head):
    """'zero' (flat, NoPE, as GGD's) or 'A,S' (theta_a=A, theta_s=S per head; '1,0': Cauchy)."""
    if spec == "zero":
        return torch.zeros(n_head), torch.zeros(n_head)
    return _two_floats(spec, n_head, "A,S", "'zero'")


register(
    Prior(
        name="cauchy",
        fn=cauchy_prior,
        params=("theta_a", "theta_s"),
        init=cauchy_init,
        trainable=("theta_a", "theta_s"),
        formula="B(d) = -θa log(1 + (d / exp(θs))²)",
        highlight=lambda theta_a, theta_s: theta_a < 0,
        highlight_label="θa < 0",
    )
)


# ---- The published biases: KERPLE, T5, Sandwich, an MLP of the distance
# Where a paper clamps a param after each optimizer step (as KERPLE's code), the prior here
# reparametrises it (softplus, sigmoid): a pure function of its params, alike on every impl.
KERPLE_EPS = 1e-2  # KERPLE's lower bound on its params (its code clamps there)


def _softplus_inverse(r):
    # log(exp(r) - 1), stable for small r
    return r + torch.log(-torch.expm1(-r))


def _kerple_init(spec, n_head, r1_high, r2_high):
    """'paper' (KERPLE's: r1 ~ U(0, r1_high), r2 ~ U(0, r2_high) per head, >= eps, from torch's
    RNG, seeded by train.py) or 'R1,R2' for all heads."""
    if spec == "paper":
        r1 = (torch.rand(n_head) * r1_high).clamp_min(KERPLE_EPS)
        r2 = (torch.rand(n_head) * r2_high).clamp_min(KERPLE_EPS)
        return r1, r2

    r1, r2 = _two_floats(spec, n_head, "R1,R2", "'paper'")
    if (r1 <= 0).any() or (r2 <= 0).any():
        raise ValueError(f"needs R1 > 0 and R2 > 0, got {spec!r}")
    return r1, r2


def kerple_log_prior(d, theta_r1, theta_r2):
    """KERPLE, log variant (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding
    for Length Extrapolation"): B_h(d) = -r1_h log(1 + r2_h |d|), r1, r2 = softplus(theta) > 0."""
    r1, r2 = (F.softplus(t) for t in _per_head(theta_r1, theta_r2))
    return -r1 * torch.log1p(r2 * d.float().abs()[None, :])


def kerple_log_init(spec, n_head):
    """'paper' (KERPLE's: r1 ~ U(0, 2), r2 ~ U(0, 1)) or 'R1,R2'; stored as softplus^-1."""
    r1, r2 = _kerple_init(spec, n_head, 2.0, 1.0)
    return _softplus_inverse(r1), _softplus_inverse(r2)


register(
    Prior(
        name="kerple_log",
        fn=kerple_log_prior,
        params=("theta_r1", "theta_r2"),
        init=kerple_log_init,
        trainable=("theta_r1", "theta_r2"),
        formula="B(d) = -r1 log(1 + r2|d|), r = softplus(θr)",
        default_init="paper",
    )
)


def kerple_power_prior(d, theta_r1, theta_r2):
    """KERPLE, power variant (Chi et al. 2022): B_h(d) = -r1_h |d|^r2_h, r1 > 0 as softplus(theta),
    0 < r2 < 2 as 2 sigmoid(theta) (KERPLE clamps r2 to [eps, 2]); r2 = 1 is ALiBi."""
    r1 = F.softplus(theta_r1.float())[:, None]
    r2 = 2.0 * torch.sigmoid(theta_r2.float())[:, None]

    dist = d.float().abs()[None, :]
    # |d|^r2 is 0 at d = 0, and so is its r2-derivative |d|^r2 log|d| (not NaN)
    power = torch.where(dist > 0, dist.clamp_min(1.0) ** r2, 0.0)
    return -r1 * power


def kerple_power_init(spec, n_head):
    """'paper' (KERPLE's: r1 ~ U(0, 1), r2 ~ U(0, 2)) or 'R1,R2' (0 < R2 < 2); stored as
    softplus^-1, logit(r2 / 2)."""
    r1, r2 = _kerple_init(spec, n_head, 1.0, 2.0)
    if (r2 >= 2).any():
        raise ValueError(f"needs R2 < 2, got {spec!r}")

    half = (r2 / 2).clamp(max=1 - KERPLE_EPS / 2)
    return _softplus_inverse(r1), torch.logit(half)


register(
    Prior(
        name="kerple_power",
        fn=kerple_power_prior,
        params=("theta_r1", "theta_r2"),
        init=kerple_power_init,
        trainable=("theta_r1", "theta_r2"),
        formula="B(d) = -r1|d|^r2, r1 = softplus(θr1), r2 = 2 sigmoid(θr2)",
        shape_param="theta_r2",
        default_init="paper",
    )
)


# T5's bucket count; the last bucket holds all keys beyond T5_MAX_DISTANCE
T5_BUCKETS = 32
T5_MAX_DISTANCE = 128


def t5_buckets(d, n_buckets=T5_BUCKETS, max_distance=T5_MAX_DISTANCE):
    """T5's unidirectional bucket per distance (Raffel et al. 2020, "Exploring the Limits of
    Transfer Learning with a Unified Text-to-Text Transformer"): n = -d keys back, one bucket each
    for n < n_buckets / 2, then log-spaced to max_distance, the last holding all beyond; d > 0
    (never visible) is bucket 0."""
    n = (-d).clamp_min(0).to(torch.int64)
    exact = n_buckets // 2
    log_ratio = torch.log(n.float().clamp_min(1) / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (n_buckets - exact)).to(torch.int64)
    return torch.where(n < exact, n, far.clamp_max(n_buckets - 1))


def t5_bucket_prior(d, buckets):
    """T5's relative attention bias: B_h(d) = buckets_h[bucket(d)], a learned row per head (T5
    shares one set across layers; here each layer has its own)."""
    return buckets.float()[:, t5_buckets(d, buckets.shape[1])]


def t5_bucket_init(spec, n_head):
    """'zero' (all buckets 0: flat, NoPE, as GGD's; T5 draws N(0, 1/sqrt(D)), D unknown here).
    Buckets beyond the training length, never trained, keep it."""
    if spec != "zero":
        raise ValueError(f"must be 'zero', got {spec!r}")
    return (torch.zeros(n_head, T5_BUCKETS),)


register(
    Prior(
        name="t5_bucket",
        fn=t5_bucket_prior,
        params=("buckets",),
        init=t5_bucket_init,
        trainable=("buckets",),
        formula=f"B(d) = buckets[bucket(d)], {T5_BUCKETS} buckets to |d| = {T5_MAX_DISTANCE}",
    )
)


SANDWICH_DIM = 128  # sinusoid dim (Sandwich's d-bar; NeMo's port uses the model width)


def sandwich_prior(d, scale):
    """Sandwich (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via the Lens of
    Receptive Field Analysis"): sinusoidal embeddings' inner product at distance d is sum_k
    cos(d w_k), w_k = 10000^(-2k/d-bar), k = 1..d-bar/2. Minus its d = 0 value, over a per-head
    scale: a parameter-free log-prior, decaying like a log, then flat."""
    k = torch.arange(1, SANDWICH_DIM // 2 + 1, dtype=torch.float64, device=d.device)
    freq = 10000.0 ** (-2.0 * k / SANDWICH_DIM)
    inner = torch.cos(d.double()[:, None] * freq[None, :]).sum(1) - SANDWICH_DIM / 2
    return inner.float()[None, :] / scale.float()[:, None]


def sandwich_scales(n_head):
    """Sandwich's per-head scale, ALiBi's geometric one made linear: 8h/H, h = 1..H."""
    return torch.arange(1, n_head + 1, dtype=torch.float32) * 8.0 / n_head


register(
    Prior(
        name="sandwich",
        fn=sandwich_prior,
        params=("scale",),
        init=lambda spec, n_head: (sandwich_scales(n_head),),
        trainable=(),
        formula=f"B(d) = (Σk cos(d wk) - {SANDWICH_DIM // 2}) / scale, fixed",
    )
)


MLP_WIDTH = 8  # hidden layer width


def mlp_prior(d, w1, b1, w2):
    """A small MLP of log-distance, as lucidrains' DynamicPositionBias (x-transformers):
    B_h(d) = w2_h . silu(w1 u + b1), u = log(1 + |d|). Heads share the hidden layer (w1, b1),
    each reading its curve with its row of w2, as in FIRE's MLP: one set of distance features fit
    by all heads' gradients. No output bias: a per-head constant cancels in the softmax."""
    u = torch.log1p(d.float().abs())[:, None]
    # (len(d), width)
    hidden = F.silu(u * w1.float()[None, :] + b1.float()[None, :])
    return w2.float() @ hidden.T


def mlp_init(spec, n_head):
    """'paper' (nn.Linear's: w1, b1 ~ U(-1, 1), w2 ~ U(-1/sqrt(width), +)) or 'zero' (w2 = 0)."""
    if spec not in ("paper", "zero"):
        raise ValueError(f"must be 'paper' or 'zero', got {spec!r}")

    w1 = torch.rand(MLP_WIDTH) * 2 - 1
    b1 = torch.rand(MLP_WIDTH) * 2 - 1
    bound = 1 / math.sqrt(MLP_WIDTH)
    w2 = (torch.rand(n_head, MLP_WIDTH) * 2 - 1) * bound
    if spec == "zero":
        w2 = torch.zeros(n_head, MLP_WIDTH)
    return w1, b1, w2


register(
    Prior(
        name="mlp",
        fn=mlp_prior,
        params=("w1", "b1", "w2"),
        init=mlp_init,
        trainable=("w1", "b1", "w2"),
        shared=("w1", "b1"),
        formula=f"B(d) = w2 · silu(w1 log(1 + |d|) + b1), width {MLP_WIDTH}",
        default_init="paper",
    )
)
