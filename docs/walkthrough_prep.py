"""Make the CPU walkthrough's inputs (docs/walkthrough.md): a BPE tokenizer with the debug
flavor's 2,048-token vocabulary, trained on this repository's text, and a randomly initialized
Hugging Face Llama with the debug flavor's shape.

    python docs/walkthrough_prep.py        # writes tokenizer.json and hf-debug/ here

Needs the `data` extra (pip install -e '.[data,watch]', as the walkthrough installs). The Hugging
Face directory is written as transformers' LlamaForCausalLM.save_pretrained would (config.json
and model.safetensors, its tensor names), without transformers: its weights are random anyway.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

DIM, LAYERS, HEADS, KV_HEADS, VOCAB, FFN = 256, 2, 8, 4, 2048, 704  # titan's llama3 debug flavor

repo = Path(__file__).resolve().parent.parent
files = sorted(str(p) for p in [*repo.glob("*/*.py"), *repo.glob("*.md"), *repo.glob("*/*.md")])
tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.train(files, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<|end_of_text|>"]))
tokenizer.save("tokenizer.json")

torch.manual_seed(0)
head_dim = DIM // HEADS
shapes = {"model.embed_tokens.weight": (VOCAB, DIM), "model.norm.weight": (DIM,), "lm_head.weight": (VOCAB, DIM)}
for i in range(LAYERS):
    p = f"model.layers.{i}."
    shapes.update({p + "self_attn.q_proj.weight": (HEADS * head_dim, DIM),
                   p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, DIM),
                   p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, DIM),
                   p + "self_attn.o_proj.weight": (DIM, HEADS * head_dim),
                   p + "mlp.gate_proj.weight": (FFN, DIM), p + "mlp.up_proj.weight": (FFN, DIM),
                   p + "mlp.down_proj.weight": (DIM, FFN),
                   p + "input_layernorm.weight": (DIM,), p + "post_attention_layernorm.weight": (DIM,)})
# As transformers initializes a Llama: normal(0, 0.02) matrices, norms at one.
tensors = {name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape) * 0.02 for name, shape in shapes.items()}
out = Path("hf-debug")
out.mkdir(exist_ok=True)
save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
(out / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": DIM, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": head_dim, "vocab_size": VOCAB,
    "intermediate_size": FFN, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "max_position_embeddings": 8192,
    "torch_dtype": "float32"}, indent=2))
print(f"wrote tokenizer.json (trained on {len(files)} files) and {out}/")
