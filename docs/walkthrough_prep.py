"""Make the CPU walkthrough's inputs (docs/walkthrough.md): a BPE tokenizer with the debug
flavor's 2,048-token vocabulary, trained on this repository's text, and a randomly initialized
Hugging Face Llama with the debug flavor's shape.

    python docs/walkthrough_prep.py        # writes tokenizer.json and hf-debug/ here
Needs the `data` extra and transformers (both in the `test` extra).
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

repo = Path(__file__).resolve().parent.parent
files = sorted(str(p) for p in [*repo.glob("*/*.py"), *repo.glob("*.md"), *repo.glob("*/*.md")])
tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.train(files, trainers.BpeTrainer(vocab_size=2048, special_tokens=["<unk>", "<|end_of_text|>"]))
tokenizer.save("tokenizer.json")
torch.manual_seed(0)
config = LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                     vocab_size=2048, intermediate_size=704, rms_norm_eps=1e-5, rope_theta=500000.0,
                     tie_word_embeddings=False)
LlamaForCausalLM(config).save_pretrained("hf-debug", safe_serialization=True)
print(f"wrote tokenizer.json (trained on {len(files)} files) and hf-debug/")
