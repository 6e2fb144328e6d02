# The worker image: `docker build -t kafka-taskq .`, then `docker run kafka-taskq worker MODULE:ATTR ...`.
# The first stage builds kafka-taskq's wheel and the wheels of its dependencies; the second installs them
# from there alone (no compiler, no build tools, no network), runs as an unprivileged user and starts
# `taskq`. No setting and no secret is baked in: TASKQ_* variables come from the environment at run time.
# An application adds its handlers on top (`FROM kafka-taskq`, copy the code into /app, the working
# directory that `taskq worker` imports MODULE from).

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY taskq ./taskq
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
# Nothing writes bytecode at run time (the root filesystem may be read-only), and logs reach the
# container runtime line by line.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/kafka_taskq-*.whl
# A fixed numeric uid and gid: Kubernetes' runAsNonRoot can check a numeric user only, and
# deploy/kubernetes runs the pods as the same ids.
RUN groupadd --system --gid 10001 taskq \
    && useradd --no-log-init --system --uid 10001 --gid 10001 --no-create-home taskq
WORKDIR /app
USER 10001:10001
# --metrics-port: /metrics and /healthz (deploy/kubernetes uses 9400). No HEALTHCHECK: a worker serves
# /healthz only when given --metrics-port, and Kubernetes' probes call it (deploy/kubernetes/worker.yaml).
EXPOSE 9400
ENTRYPOINT ["taskq"]
CMD ["--help"]
