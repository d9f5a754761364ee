# kvferry sidecar image: multi-stage, non-root. CPU by default; `--build-arg VARIANT=cuda` for CUDA torch.
ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04

FROM ${PYTHON_IMAGE} AS base-cpu
ENV TORCH_SPEC="torch==2.13.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"

FROM ${CUDA_IMAGE} AS base-cuda
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/* && ln -sf /usr/bin/python3.11 /usr/local/bin/python
ENV TORCH_SPEC="torch==2.13.0" TORCH_INDEX=""

# Build the venv on the same base the image runs on, so its interpreter path is valid there.
FROM base-${VARIANT} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvferry kvferry
COPY mappings mappings
COPY common common
COPY sidecar sidecar
COPY client client
COPY proto proto
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir $TORCH_INDEX "$TORCH_SPEC" \
 && /opt/venv/bin/pip install --no-cache-dir '.[server,fast]'

FROM base-${VARIANT}
COPY --from=build /opt/venv /opt/venv
COPY maps /opt/kvferry/maps
RUN groupadd --gid 10001 kvferry && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvferry
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 50551 9100
ENTRYPOINT ["kvferry"]
CMD ["serve", "--maps-dir", "/opt/kvferry/maps", "--host", "0.0.0.0"]
