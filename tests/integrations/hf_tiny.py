"""Tiny models people train, built from configs (no download): HF Llama and GPT-2, timm ViT,
torchvision ResNet-18. Each builder takes a seed and returns ``(model, make_batch, loss_of)``:
``make_batch(step)`` a batch (seeded by the step), ``loss_of(model, batch)`` the scalar loss."""

import torch
import torch.nn.functional as F

VOCAB = 64


def _tokens(step: int, batch: int = 4, seq: int = 16):
    # A learnable toy language: each token is the previous one plus 1 (mod VOCAB), from random starts.
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, VOCAB, (batch, 1), generator=g)
    return (starts + torch.arange(seq)) % VOCAB


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def llama(seed: int = 0, head_dim: int = 32, max_positions: int = 8192):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                      max_position_embeddings=max_positions)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg), _tokens, _lm_loss


def gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg), _tokens, _lm_loss


def _images(step: int, batch: int = 8, size: int = 64):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _image_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def vit(seed: int = 0):
    import timm
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, patch_size=16,
                              embed_dim=32, depth=2, num_heads=2, num_classes=10)
    return model, _images, _image_loss


def resnet18(seed: int = 0):
    import torchvision
    torch.manual_seed(seed)
    return torchvision.models.resnet18(num_classes=10), _images, _image_loss


BUILDERS = {"llama": (llama, "transformers"), "gpt2": (gpt2, "transformers"), "vit": (vit, "timm"),
            "resnet18": (resnet18, "torchvision")}
