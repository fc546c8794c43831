"""What the precision scripts share (tests/scripts/precision_parity.py, loss_scale.py,
fabric_precision.py): a transformers Llama, the model the ``16-mixed`` loss-scale trajectories are
checked on, and the overflow they inject (an inf in one element of one rank's gradient)."""

from __future__ import annotations

import lightning as L
import torch

HF_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)  # fmt: skip


def hf_llama() -> torch.nn.Module:
    """A small ``transformers`` ``LlamaForCausalLM`` in fp32 (the caller seeds)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**HF_LLAMA))


class HFLlama(L.LightningModule):
    """:func:`hf_llama` as a LightningModule (built in ``__init__``: the same fp32 init on every
    strategy), AdamW at lr 1e-2."""

    def __init__(self) -> None:
        super().__init__()
        self.model = hf_llama()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def poison_grad(weight: torch.Tensor, index: int = 5):
    """Put an inf into element ``index`` of ``weight``'s gradient in the next backward (one element:
    after the reduction it lies in one rank's shard only). Returns the hook's handle."""

    def inject(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[index] = float("inf")
        return grad

    return weight.register_hook(inject)
