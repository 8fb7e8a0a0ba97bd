#!/usr/bin/env bash
# The wheels the GPU check installs there (no network on the GPU machines): torchft and what it imports, for their
# Python (3.12), into .whl/ (git-ignored). The device call then carries .whl; scripts/gpu_check.sh installs them.
#
#   scripts/gpu_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
grep -qx '/.whl/' .git/info/exclude 2> /dev/null || echo /.whl/ >> .git/info/exclude
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
# torchft imports OpenTelemetry at its top; requests and protobuf come with it. Versions as pip resolved them here.
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  "${platforms[@]}" -d .whl torchft==0.2.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 googleapis-common-protos==1.76.0 \
  protobuf==7.36.2 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 \
  idna==3.20 typing-extensions==4.16.0 importlib-metadata==10.2.0 zipp==4.1.2
ls .whl
