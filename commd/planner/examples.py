"""Layer graphs of the benchmark's model families, built from their sizes (no torch needed):
a multi-layer perceptron, a GPT of pre-norm transformer blocks, and a VGG-like CNN."""

from __future__ import annotations

from commd.planner.graph import Layer, LayerGraph


def mlp(batch: int, width: int, depth: int, inputs: int | None = None, outputs: int | None = None) -> LayerGraph:
    """``depth`` linear layers of ``width`` with activations between them."""
    inputs, outputs = inputs or width, outputs or width
    layers = [Layer("x", "input", (), (batch, inputs))]
    prev, fan_in = "x", inputs
    for i in range(depth):
        fan_out = outputs if i == depth - 1 else width
        layers.append(Layer(f"fc{i}", "linear", (prev,), (batch, fan_out), params=fan_in * fan_out + fan_out,
                            flops=2.0 * batch * fan_in * fan_out, attrs={"in_features": fan_in, "out_features": fan_out}))
        prev = f"fc{i}"
        if i < depth - 1:
            layers.append(Layer(f"act{i}", "follow", (prev,), (batch, fan_out)))
            prev = f"act{i}"
        fan_in = fan_out
    layers.append(Layer("loss", "output", (prev,), (1,)))
    return LayerGraph(layers, 4, f"mlp(batch={batch}, width={width}, depth={depth})")


def gpt(batch: int, seq: int, hidden: int, heads: int, blocks: int, vocab: int) -> LayerGraph:
    """Token embedding, ``blocks`` pre-norm blocks (norm, attention, residual add, norm, 4x MLP,
    residual add), a final norm and the vocabulary projection."""
    act = (batch, seq, hidden)
    tokens = batch * seq
    layers = [Layer("tokens", "input", (), (batch, seq)),
              Layer("embed", "embedding", ("tokens",), act, params=vocab * hidden)]
    prev = "embed"
    for b in range(blocks):
        p = f"h{b}."
        attn_flops = 2.0 * tokens * hidden * 4 * hidden + 4.0 * batch * seq * seq * hidden
        layers += [
            Layer(p + "ln1", "layernorm", (prev,), act, params=2 * hidden, flops=5.0 * tokens * hidden),
            Layer(p + "attn", "attention", (p + "ln1",), act, params=4 * hidden * hidden + 4 * hidden,
                  flops=attn_flops, attrs={"heads": heads}),
            Layer(p + "add1", "follow", (prev, p + "attn"), act, attrs={"linear": True}),
            Layer(p + "ln2", "layernorm", (p + "add1",), act, params=2 * hidden, flops=5.0 * tokens * hidden),
            Layer(p + "fc1", "linear", (p + "ln2",), (batch, seq, 4 * hidden), params=4 * hidden * hidden + 4 * hidden,
                  flops=8.0 * tokens * hidden * hidden),
            Layer(p + "gelu", "follow", (p + "fc1",), (batch, seq, 4 * hidden)),
            Layer(p + "fc2", "linear", (p + "gelu",), act, params=4 * hidden * hidden + hidden,
                  flops=8.0 * tokens * hidden * hidden),
            Layer(p + "add2", "follow", (p + "add1", p + "fc2"), act, attrs={"linear": True}),
        ]
        prev = p + "add2"
    layers += [Layer("ln_f", "layernorm", (prev,), act, params=2 * hidden, flops=5.0 * tokens * hidden),
               Layer("head", "linear", ("ln_f",), (batch, seq, vocab), params=hidden * vocab,
                     flops=2.0 * tokens * hidden * vocab),
               Layer("loss", "output", ("head",), (1,))]
    return LayerGraph(layers, 4, f"gpt(batch={batch}, seq={seq}, hidden={hidden}, blocks={blocks}, vocab={vocab})")


def cnn(batch: int, image: int = 32, channels: tuple[int, ...] = (64, 128, 256), classifier: int = 4096,
        classes: int = 10) -> LayerGraph:
    """VGG-like: 3x3 convolutions (each halving the image through a pooling step), then a heavy
    fully connected classifier."""
    layers = [Layer("x", "input", (), (batch, 3, image, image))]
    prev, c_in, size = "x", 3, image
    for i, c_out in enumerate(channels):
        layers.append(Layer(f"conv{i}", "conv2d", (prev,), (batch, c_out, size, size), params=9 * c_in * c_out + c_out,
                            flops=2.0 * batch * size * size * 9 * c_in * c_out))
        size //= 2
        layers.append(Layer(f"pool{i}", "follow", (f"conv{i}",), (batch, c_out, size, size)))
        prev, c_in = f"pool{i}", c_out
    flat = c_in * size * size
    layers.append(Layer("flatten", "follow", (prev,), (batch, flat)))
    prev = "flatten"
    for i, (fan_in, fan_out) in enumerate([(flat, classifier), (classifier, classifier), (classifier, classes)]):
        layers.append(Layer(f"fc{i}", "linear", (prev,), (batch, fan_out), params=fan_in * fan_out + fan_out,
                            flops=2.0 * batch * fan_in * fan_out))
        prev = f"fc{i}"
        if i < 2:
            layers.append(Layer(f"relu{i}", "follow", (prev,), (batch, fan_out)))
            prev = f"relu{i}"
    layers.append(Layer("loss", "output", (prev,), (1,)))
    return LayerGraph(layers, 4, f"cnn(batch={batch}, image={image}, channels={list(channels)}, classifier={classifier})")
