"""Image LoRA (Stable Diffusion / SDXL): kohya-style networks, files, data and training.

* ``models.py``: load SD1.x/2.x/SDXL offline (diffusers dir, or single file + config dir);
* ``network.py``: kohya-style LoRA modules on the UNet and CLIP text encoders, fused kernels;
* ``kohya.py``: the kohya ``.safetensors`` LoRA file: key names, tensors, ``ss_*`` metadata;
* ``data.py``: ``N_concept`` folders, caption sidecars, aspect-ratio buckets;
* ``cache.py``: latent and text-encoder-output caches;
* ``config.py``: ``ImageTrainConfig``, the settings of ``lorafuse train-image``;
* ``trainer.py``: the training loop, checkpoints and resume;
* ``sampling.py``: sample images from a prompts file during training;
* ``bench.py``: ``lorafuse bench --task sd15|sdxl``.
"""
