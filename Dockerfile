# One image for the supervisor worker and the node agents.
FROM python:3.11-slim
WORKDIR /app
COPY . .
RUN pip install --no-cache-dir --constraint constraints.txt .
ENV PYTHONUNBUFFERED=1
