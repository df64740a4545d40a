"""
The positional priors of bam-gpt: the one place that says what a prior is. Open this file first to
try your own.

A prior is a log-prior B_h(d) over the signed distance d = j - i from query i to key j (d <= 0 under
the causal mask), one curve per head h, added to the attention logits: softmax(q.k/sqrt(D) + B) is
the posterior over which key to read. A Prior is registered under its name with
    fn(d, *params) -> (H, len(d)) float32   the log-prior; d 1-D distances, params (H,) tensors
    params, init(spec, H), trainable        per-head parameter names, their bam_init values
and optionally, for figures and logs: formula, shape_param (labels a head; default the first
trainable) and highlight(*params) -> (H,) bool with its highlight_label. Shipped: ggd (the paper's),
alibi and cauchy. Names: a prior's name is a string (GPTConfig.prior), a Prior is the registered
family, a BoundPrior is a Prior with one layer's parameters.
"""

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

# The floor of every log-prior, in nats: BoundPrior.table clamps B(d) there (zero derivative below),
# so that every impl computes the same bounded scores. Where a row can see a key whose score beats
# the floor by more than ~104 nats, exp() of a floored score is exactly 0 in fp32 both before and
# after the clamp; a row with one visible key has P = 1 whatever its prior. So the floor changes
# nothing unless every key a row sees sits within ~104 / r nats of it (r: SSMax's row scale). What
# it removes: log-priors like GGD's -3e7 at d = mu (theta_beta < 0), whose fp32 scores keep no trace
# of the content, and whose derivatives (up to 1e20 and beyond) would turn rounding noise into
# gradients or overflow to inf.
LOG_PRIOR_FLOOR = -1e4


@dataclass(frozen=True)
class Prior:
    name: str
    fn: Callable
    params: tuple
    init: Callable
    trainable: tuple
    formula: str = ""
    shape_param: str = ""
    highlight: Optional[Callable] = None
    highlight_label: str = ""

    # the figure fields' defaults, so that the five required fields make a full prior
    def __post_init__(self):
        if not self.formula:
            formula = f"B(d) = {self.fn.__name__}(d, {', '.join(self.params)})"
            object.__setattr__(self, "formula", formula)
        if not self.shape_param:
            candidates = tuple(self.trainable) + tuple(self.params) + ("",)
            object.__setattr__(self, "shape_param", candidates[0])


class BoundPrior(NamedTuple):
    """A prior with one layer's parameters: what attention() receives as `prior`."""

    prior: Prior
    params: tuple

    def table(self, d):
        """The log-prior at distances d (1-D) as attention uses it, floored at LOG_PRIOR_FLOOR:
        (H, len(d)) float32."""
        return self.prior.fn(d, *self.params).clamp_min(LOG_PRIOR_FLOOR)


PRIORS = {}


def register(prior):
    """Add a prior to the registry (under prior.name) and return it."""
    if PRIORS.get(prior.name, prior) is not prior:
        raise ValueError(f"a different prior is already registered as {prior.name!r}")
    if not set(prior.trainable) | {prior.shape_param} <= set(prior.params):
        raise ValueError(
            f"prior {prior.name!r}: trainable {prior.trainable} and shape_param "
            f"{prior.shape_param!r} must be among its params {prior.params}"
        )
    PRIORS[prior.name] = prior
    return prior


def get_prior(name):
    """The registered prior of that name (a ValueError names the registered ones)."""
    if name not in PRIORS:
        raise ValueError(f"unknown prior {name!r}; registered priors: {', '.join(PRIORS)}")
    return PRIORS[name]


def bind(prior):
    """attention()'s `prior` argument as a BoundPrior: None stays None, a bare 3-tuple of (H,)
    tensors is GGD."""
    if prior is None or isinstance(prior, BoundPrior):
        return prior
    is_triple = isinstance(prior, (tuple, list)) and len(prior) == 3
    if is_triple and all(torch.is_tensor(t) for t in prior):
        return BoundPrior(PRIORS["ggd"], tuple(prior))
    raise TypeError(
        "prior must be None, a BoundPrior, or a GGD triple (theta_alpha, theta_beta, theta_mu) of "
        f"(H,) tensors; got {type(prior).__name__}"
    )


def _per_head(*params):  # (H,) parameters as (H, 1) columns against the distances
    return (t.float()[:, None] for t in params)


def _two_floats(spec, n_head, names, options):
    """An init spec "A,B" as two (H,) tensors, every head at A and at B."""
    try:
        first, second = (float(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"must be {options} or '{names}' (two floats), got {spec!r}") from None
    return torch.full((n_head,), first), torch.full((n_head,), second)


# ---- GGD ---------------------------------------------------------------------------------------
# keeps (|d - mu| + eps)^theta_beta finite at d = mu when theta_beta < 0 (the authors' value)
GGD_EPS = 1e-5


def ggd_mu(theta_mu):
    """mu = 2 sinh(theta_mu) = exp(theta_mu) - exp(-theta_mu): an odd, unbounded reparametrisation
    of the centre."""
    return 2.0 * torch.sinh(theta_mu)


def ggd_prior(d, theta_alpha, theta_beta, theta_mu):
    """GGD-BAM: B_h(d) = -exp(theta_alpha_h) * (|d - mu_h| + eps)^theta_beta_h, a generalised
    Gaussian log-density: theta_beta = 1 is Laplace (ALiBi), 0 is uniform (NoPE), < 0 puts the mass
    *far* from the query."""
    d = d.float()[None, :]
    alpha, beta, mu_raw = _per_head(theta_alpha, theta_beta, theta_mu)
    return -torch.exp(alpha) * torch.pow((d - ggd_mu(mu_raw)).abs() + GGD_EPS, beta)


def ggd_init(spec, n_head):
    """'zero' (the authors' default: a constant prior, BAM starts as NoPE), 'alibi', 'linear'
    (theta_beta spread over [0, 1] across heads) or 'A,B' (theta_alpha=A, theta_beta=B for every
    head); theta_mu starts at 0."""
    theta_mu = torch.zeros(n_head)
    if spec == "zero":
        return torch.zeros(n_head), torch.zeros(n_head), theta_mu
    if spec == "alibi":  # exp(theta_alpha) = the slope, theta_beta = 1: ALiBi's -m|d|
        return alibi_slopes(n_head).log(), torch.ones(n_head), theta_mu
    if spec == "linear":
        return torch.zeros(n_head), torch.linspace(0.0, 1.0, n_head), theta_mu
    theta_alpha, theta_beta = _two_floats(spec, n_head, "ALPHA,BETA", "'zero', 'alibi', 'linear'")
    return theta_alpha, theta_beta, theta_mu


GGD = register(
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


# ---- ALiBi -------------------------------------------------------------------------------------
def alibi_slopes(n_head):
    """ALiBi's per-head slopes (Press et al.); n_head not a power of two as in the ALiBi reference
    code: the slopes of the power of two below it, then every other slope of the one above."""

    def geometric(n):  # 2^(-8/n), 2^(-16/n), ..., 2^(-8)
        return [2.0 ** (-8.0 * (k + 1) / n) for k in range(n)]

    below = 2 ** int(math.floor(math.log2(n_head)))
    extra = geometric(2 * below)[0::2][: n_head - below]
    return torch.tensor(geometric(below) + extra, dtype=torch.float32)


def alibi_prior(d, slope):
    """ALiBi (Press et al.): B_h(d) = -m_h |d|, a Laplace prior centred on the query (the paper's
    Lemma 2)."""
    (m,) = _per_head(slope)
    return -m * d.float().abs()[None, :]


ALIBI = register(
    Prior(
        name="alibi",
        fn=alibi_prior,
        params=("slope",),
        trainable=(),
        init=lambda spec, n_head: (alibi_slopes(n_head),),
        formula="B(d) = -m|d|, fixed slopes m",
    )
)


# ---- Cauchy ------------------------------------------------------------------------------------
def cauchy_prior(d, theta_a, theta_s):
    """B_h(d) = -theta_a_h log(1 + (d / exp(theta_s_h))^2), heavy-tailed (README, "Try your own
    prior"): theta_a = 1 is Cauchy of scale exp(theta_s), > 0 Student-t (a power-law tail), 0 flat
    (NoPE), < 0 favours distant keys."""
    power, log_scale = _per_head(theta_a, theta_s)
    return -power * torch.log1p((d.float()[None, :] / torch.exp(log_scale)) ** 2)


def cauchy_init(spec, n_head):
    """'zero' (flat, NoPE, like GGD's) or 'A,S' (theta_a=A, theta_s=S for every head; '1,0' is
    standard Cauchy)."""
    if spec == "zero":
        return torch.zeros(n_head), torch.zeros(n_head)
    return _two_floats(spec, n_head, "A,S", "'zero'")


CAUCHY = register(
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
