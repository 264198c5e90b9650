"""The PaddlePaddle model, imported only inside worker processes.

`runner` (`PaddleRunner`: a packed batch in, outputs out) drives the forward; `weights` lays a
`PaddleModel`'s tensors out on the device; `env`, `gemm` and `onednn` set the CPU math up (threads,
oneDNN/MKL products); `attention`, `norm`, `ops` (RoPE, SwiGLU, masked softmax), `softmax`
and `moe` are the layers; `head` and `logits` the outputs (next token, logprobs, top-k,
embeddings); `prefix` the prefix-cache reads and writes; `shard` a tensor-parallel rank's
share; `rows` checks that a product gives a row the same bits whatever the batch. `encoder`
(BERT, XLM-RoBERTa) and `modernbert` are the encoder runners; `encoder_fused` runs `encoder`'s
forward on oneDNN's primitives (`dnnl`, `fused`) on a CPU.
"""
