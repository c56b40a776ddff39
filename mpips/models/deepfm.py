"""DeepFM: first-order term + FM over the pooled slot vectors + the CTR-DNN's MLP.

Same table rows (``[w | v]``), inputs and flat parameter vector as
:class:`mpips.models.wide_deep.WideDeep`; the logit adds the FM term over the pooled slot
vectors ``p_f`` (d values each)::

    first  = w_0 + sum_f pool(w)_f + u . dense
    fm     = 0.5 * sum_k [ (sum_f p_fk)^2 - sum_f p_fk^2 ]  = sum_{f<g} <p_f, p_g>
    logit  = first + fm + MLP(concat(p, dense))

For one-hot slots ``fm`` is the classic factorization machine's pairwise term.  For a
multi-hot (bag) slot ``p_f`` is the pooled bag, so ``fm`` holds the pairs of ids in
different slots (scaled by the pooling), not the pairs inside one bag.
"""
from mpips.models.wide_deep import WideDeep


class DeepFM(WideDeep):
    """DeepFM over a flat parameter vector (same arguments as :class:`CTRDNN`)."""
    name = "deepfm"
    USE_FM = True
