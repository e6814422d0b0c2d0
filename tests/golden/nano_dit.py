"""Write the 11,000-parameter PixArt transformer the golden checkpoints fine-tune (`model.pretrained`): the smallest
preset (`micro`, 0.7 M parameters) makes a 12 MB checkpoint, this one a ~200 KB one.

    python tests/golden/nano_dit.py tests/golden/nano_dit

Its weights do not matter (a resume overwrites them); its shapes do: 4-channel latents (the shapes VAE), 64-d text
states (the tiny-words T5), patch 2, one block of 2 heads of 8.
"""

import sys

import torch
from diffusers import PixArtTransformer2DModel

if __name__ == "__main__":
    torch.manual_seed(0)
    PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                             num_layers=1, cross_attention_dim=16, caption_channels=64, sample_size=4, patch_size=2,
                             use_additional_conditions=False).save_pretrained(sys.argv[1])
