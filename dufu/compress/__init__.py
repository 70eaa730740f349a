"""Making a trained model smaller and cheaper to run: post-training quantization (on torchao) and structured
pruning. Transforms of an ``nn.Module`` on one device, like :mod:`dufu.delta`; reading runs and writing
directories is the engine's job."""
