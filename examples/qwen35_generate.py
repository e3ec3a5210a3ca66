"""A tiny random Qwen3.5 text model from transformers, patched onto lrdsl, generates.

    python examples/qwen35_generate.py

Greedy decoding of 20 tokens with the model's own layers, then with its linear-attention layers
patched onto lrdsl's kernels (lrdsl.integrations.patch_qwen35), then unpatched again.
"""
from __future__ import annotations

from lrdsl import config

config.use_interpreter_without_gpu()  # before anything imports triton

import torch  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

from lrdsl.integrations import patch_qwen35, unpatch  # noqa: E402


def main():
    torch.manual_seed(0)
    model_config = Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Qwen3_5ForCausalLM(model_config).to(device).eval()
    with torch.no_grad():  # weights at O(1) activation scales, so the greedy tokens are not all alike
        for parameter in model.parameters():
            parameter.normal_(0, parameter.shape[-1] ** -0.5 if parameter.dim() > 1 else 0.5)
    prompt = torch.randint(1, model_config.vocab_size, (2, 8), device=device)
    options = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)

    theirs = model.generate(prompt, **options)
    patch_qwen35(model)
    print(model.model.layers[0].linear_attn.extra_repr())
    ours = model.generate(prompt, **options)
    unpatch(model)
    print("transformers:", theirs[:, prompt.shape[1]:].tolist())
    print("lrdsl:       ", ours[:, prompt.shape[1]:].tolist())
    print("identical" if torch.equal(ours, theirs) else "DIFFERENT")


if __name__ == "__main__":
    main()
