"""Image LoRA (Stable Diffusion / SDXL): kohya-style networks, files, data and training.

* ``models.py``: load SD1.x/2.x/SDXL offline (diffusers dir, or single file + config dir);
* ``network.py``: kohya-style LoRA modules on the UNet and CLIP text encoders, fused kernels;
* ``kohya.py``: the kohya ``.safetensors`` LoRA file: tensors, ``ss_*`` metadata, hashes;
* ``kohya_names.py``: its key names (diffusers paths, SDXL's SGM layout, text encoders);
* ``data.py``: ``N_concept`` folders, caption sidecars, aspect-ratio buckets;
* ``cache.py``: latent and text-encoder-output caches;
* ``config.py``: ``ImageTrainConfig``, the settings of ``lorafuse train-image``;
* ``trainer.py``: the training step in the shared loop shell;
* ``run_files.py``: the kohya file it writes, checkpoint state and resume, ``--network-weights``;
* ``sampling.py``: sample images from a prompts file during training.

``lorafuse bench --task sd15|sdxl`` lives in :mod:`lorafuse.bench.image`.
"""
