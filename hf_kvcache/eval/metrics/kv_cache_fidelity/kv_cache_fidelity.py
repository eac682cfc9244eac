"""`evaluate` metric: how faithfully a KV cache preserves a model's next-token distributions.

Load it from its folder: ``evaluate.load(hf_kvcache.eval.FIDELITY_METRIC_PATH)``.
"""

import datasets
import evaluate
import torch

from hf_kvcache.eval.fidelity import fidelity_from_logits

_DESCRIPTION = """
Compares next-token logits produced through a candidate KV cache (predictions) with those of the
full-precision baseline cache on the same tokens (references), one vocabulary-sized row per position:
mean KL(baseline || candidate) in nats and top-1 (argmax) agreement. With `labels` (the true next
tokens) it also returns both perplexities and the relative perplexity change.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of logit rows (list of float) from the candidate cache, one per position.
    references: list of logit rows from the baseline cache, same positions and vocabulary.
    labels: optional list of int, the true next token of each position.
Returns:
    kl_divergence, top1_agreement, and with labels: perplexity, baseline_perplexity, perplexity_change_relative.
Example:
    >>> metric = evaluate.load(FIDELITY_METRIC_PATH)
    >>> metric.compute(predictions=[[0.0, 1.0]], references=[[0.0, 1.0]])
    {'kl_divergence': 0.0, 'top1_agreement': 1.0}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class KVCacheFidelity(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("float32")),
                    "references": datasets.Sequence(datasets.Value("float32")),
                }
            ),
        )

    def _compute(self, predictions, references, labels=None):
        logits = torch.tensor(predictions, dtype=torch.float32)  # [positions, vocab]
        baseline = torch.tensor(references, dtype=torch.float32)  # [positions, vocab]
        targets = torch.tensor(labels if labels is not None else [0] * len(logits))  # [positions]
        nll, kl, agree = fidelity_from_logits(logits, baseline, targets)
        result = {"kl_divergence": kl.mean().item(), "top1_agreement": agree.float().mean().item()}
        if labels is not None:
            base_nll = fidelity_from_logits(baseline, baseline, targets)[0]
            perplexity, baseline_perplexity = nll.mean().exp().item(), base_nll.mean().exp().item()
            result |= {
                "perplexity": perplexity,
                "baseline_perplexity": baseline_perplexity,
                "perplexity_change_relative": perplexity / baseline_perplexity - 1,
            }
        return result
