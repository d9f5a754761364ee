{{/* Names and labels. */}}
{{- define "kvferry.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvferry.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvferry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvferry.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvferry.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvferry.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvferry.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvferry.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvferry.redisSecretName" -}}
{{- default (printf "%s-redis" (include "kvferry.fullname" .)) .Values.redis.existingSecret -}}
{{- end -}}

{{- define "kvferry.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "kvferry.fullname" .)) .Values.tls.existingSecret -}}
{{- end -}}

{{/* Seconds Kubernetes waits after SIGTERM: the preStop pause, the drain, and a margin. */}}
{{- define "kvferry.terminationGrace" -}}
{{- add (int .Values.sidecar.preStopSeconds) (int .Values.sidecar.drainSeconds) 10 -}}
{{- end -}}

{{/*
The kvferry sidecar container. Other charts can include it in their own pod spec:
  containers:
    - {{ include "kvferry.sidecarContainer" . | nindent 6 }}
together with the volumes from "kvferry.volumes".
*/}}
{{- define "kvferry.sidecarContainer" -}}
name: kvferry
image: {{ include "kvferry.image" . | toJson }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args: ["serve", "--config", "/etc/kvferry/kvferry.toml"]
ports:
  - name: grpc
    containerPort: {{ .Values.sidecar.port }}
    protocol: TCP
  - name: metrics
    containerPort: {{ .Values.sidecar.metricsPort }}
    protocol: TCP
startupProbe:
  grpc:
    port: {{ .Values.sidecar.port }}
  periodSeconds: 2
  failureThreshold: 60
livenessProbe:
  grpc:
    port: {{ .Values.sidecar.port }}
  periodSeconds: 10
  failureThreshold: 3
readinessProbe:
  grpc:
    port: {{ .Values.sidecar.port }}
    service: kvferry.v1.TranslateService
  periodSeconds: 5
  failureThreshold: 2
lifecycle:
  preStop:
    sleep:
      seconds: {{ .Values.sidecar.preStopSeconds }}
resources:
  {{- $res := deepCopy .Values.resources }}
  {{- if .Values.gpu.enabled }}
  {{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" .Values.gpu.count) (default dict $res.limits)) }}
  {{- end }}
  {{- toYaml $res | nindent 2 }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
volumeMounts:
  - name: kvferry-config
    mountPath: /etc/kvferry
    readOnly: true
  - name: kvferry-maps
    mountPath: /maps
    readOnly: true
  - name: kvferry-tmp
    mountPath: /tmp
  {{- if and .Values.sharedMemory.enabled (eq .Values.mode "podSidecar") }}
  - name: kvferry-shm
    mountPath: {{ .Values.sharedMemory.mountPath | toJson }}
  {{- end }}
  {{- if .Values.tls.enabled }}
  - name: kvferry-tls
    mountPath: /etc/kvferry-tls
    readOnly: true
  {{- end }}
  {{- if .Values.redis.url }}
  - name: kvferry-redis
    mountPath: /etc/kvferry-redis
    readOnly: true
  {{- end }}
  {{- if .Values.auth.existingSecret }}
  - name: kvferry-auth
    mountPath: /etc/kvferry-auth
    readOnly: true
  {{- end }}
{{- end -}}

{{/* Volumes the sidecar container needs. */}}
{{- define "kvferry.volumes" -}}
- name: kvferry-config
  configMap:
    name: {{ include "kvferry.fullname" . }}
- name: kvferry-tmp
  emptyDir:
    sizeLimit: 256Mi
- name: kvferry-maps
  {{- if eq .Values.maps.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-maps" (include "kvferry.fullname" .)) .Values.maps.pvc.existingClaim | toJson }}
    readOnly: true
  {{- else }}
  emptyDir:
    sizeLimit: 1Gi
  {{- end }}
{{- if .Values.tls.enabled }}
- name: kvferry-tls
  secret:
    secretName: {{ include "kvferry.tlsSecretName" . | toJson }}
{{- end }}
{{- if .Values.redis.url }}
- name: kvferry-redis
  secret:
    secretName: {{ include "kvferry.redisSecretName" . | toJson }}
{{- end }}
{{- if .Values.auth.existingSecret }}
- name: kvferry-auth
  secret:
    secretName: {{ .Values.auth.existingSecret | toJson }}
{{- end }}
{{- end -}}

{{/* initContainer that fills the maps volume from an image or a URL. */}}
{{/* The response regions' folder on the shared memory volume: what the sidecar's shm_dir, the model server's
KVFERRY_SHM_DIR and its connector's shm_dir name. The init container below makes it group-writable, sticky and
set-group-ID (kvferry shm-folder), so several clients and users share it without removing each other's files. */}}
{{- define "kvferry.shmDir" -}}
{{- printf "%s/regions" (trimSuffix "/" .Values.sharedMemory.mountPath) -}}
{{- end -}}

{{- define "kvferry.shmInit" -}}
{{- if and .Values.sharedMemory.enabled (eq .Values.mode "podSidecar") }}
- name: kvferry-shm
  image: {{ include "kvferry.image" . | toJson }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["shm-folder", {{ include "kvferry.shmDir" . | toJson }}]
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 32Mi}
    limits: {cpu: 200m, memory: 256Mi}
  volumeMounts:
    - name: kvferry-shm
      mountPath: {{ .Values.sharedMemory.mountPath | toJson }}
{{- end }}
{{- end -}}

{{- define "kvferry.mapsInit" -}}
{{- if eq .Values.maps.source "image" }}
- name: kvferry-maps
  image: {{ printf "%s:%s" (default .Values.image.repository .Values.maps.image.repository) (default (default .Chart.AppVersion .Values.image.tag) .Values.maps.image.tag) | toJson }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["cp", "-R", "--", {{ printf "%s/." .Values.maps.image.path | toJson }}, "/maps/"]
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 50m, memory: 64Mi}
    limits: {cpu: 500m, memory: 256Mi}
  volumeMounts:
    - name: kvferry-maps
      mountPath: /maps
{{- else if eq .Values.maps.source "url" }}
- name: kvferry-maps
  image: {{ include "kvferry.image" . | toJson }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["maps", "fetch", "--url", {{ .Values.maps.url.href | toJson }}, "--dest", "/maps"]
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 50m, memory: 128Mi}
    limits: {cpu: 500m, memory: 512Mi}
  volumeMounts:
    - name: kvferry-maps
      mountPath: /maps
    - name: kvferry-tmp
      mountPath: /tmp
{{- end }}
{{- end -}}
