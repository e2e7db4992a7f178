{{/* Names and labels. */}}
{{- define "epdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "epdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A role's object name; also the DNS name the proxy resolves for that role (room left for "-encoder"). */}}
{{- define "epdserve.roleName" -}}
{{- printf "%s-%s" (include "epdserve.fullname" .root | trunc 54 | trimSuffix "-") .role }}
{{- end }}

{{- define "epdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "epdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "epdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "epdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: epdserve
{{- end }}

{{- define "epdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "epdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "epdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Roles that get a Deployment, in start order; the proxy last. */}}
{{- define "epdserve.roles" -}}
{{- $roles := list }}
{{- if .Values.encoder.enabled }}{{ $roles = append $roles "encoder" }}{{ end }}
{{- $roles = concat $roles (list "prefill" "decode" "proxy") }}
{{- toJson $roles }}
{{- end }}

{{/* The container's arguments after `epdserve`: one `epdserve serve <role>` command line. */}}
{{- define "epdserve.args" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $v := index $root.Values $role }}
{{- $ports := $root.Values.ports }}
- serve
- {{ $role }}
{{- with include "epdserve.modelPath" $root }}
- --model
- {{ . | quote }}
{{- end }}
- --host
- "0.0.0.0"
{{- /* Pod names do not resolve in cluster DNS; peers must dial the pod IP. */}}
- --advertise-host
- $(POD_IP)
{{- /* Every role: the engines label their metrics with it, as the proxy does. */}}
{{- with $root.Values.model.servedModelName }}
- --served-model-name
- {{ . | quote }}
{{- end }}
{{- if eq $role "proxy" }}
- --port
- {{ $ports.proxy | quote }}
- --inbox-port
- {{ $ports.inbox | quote }}
{{- range $target := list "encoder" "prefill" "decode" }}
{{- if or (ne $target "encoder") $root.Values.encoder.enabled }}
- --{{ $target }}
- {{ printf "%s:%v" (include "epdserve.roleName" (dict "root" $root "role" $target)) $ports.control | quote }}
{{- end }}
{{- end }}
{{- if $root.Values.apiKey.protectMetrics }}
- --metrics-require-api-key
{{- end }}
{{- else }}
- --port
- {{ $ports.control | quote }}
{{- if ne $role "decode" }}
- --data-port
- {{ $ports.data | quote }}
{{- end }}
{{- if eq $role "prefill" }}
- --block-port
- {{ $ports.blocks | quote }}
{{- end }}
- --http-port
- {{ $ports.http | quote }}
- --threads
- {{ $v.threads | quote }}
{{- if gt (int (default 0 $v.gpus)) 0 }}
- --device
- cuda
{{- end }}
- --kv-transport
- {{ $root.Values.kvTransport | quote }}
{{- if eq $root.Values.kvTransport "ucx" }}
- --ucx-net-devices
- {{ $root.Values.ucxNetDevices | quote }}
{{- end }}
{{- range $root.Values.engineArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
- --drain-timeout
- {{ $root.Values.shutdown.drainTimeoutSeconds | quote }}
{{- if $root.Values.curve.existingSecret }}
- --curve-dir
- /etc/epdserve/curve
{{- end }}
{{- range $v.args }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* --model of every role: model.path, else where source hub downloads to, else empty (the demo model). */}}
{{- define "epdserve.modelPath" -}}
{{- if .Values.model.path }}
{{- .Values.model.path }}
{{- else if eq .Values.model.source "hub" }}
{{- printf "/models/%s" .Values.model.hub.repo }}
{{- end }}
{{- end }}

{{- define "epdserve.resources" -}}
{{- $v := index .root.Values .role }}
{{- $resources := deepCopy (default dict $v.resources) }}
{{- if gt (int (default 0 $v.gpus)) 0 }}
{{- $limits := default dict $resources.limits }}
{{- $_ := set $limits .root.Values.gpu.resourceName (int $v.gpus) }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* The env entry every service reads the deployment's secret from (never a command-line argument). */}}
{{- define "epdserve.secretEnv" -}}
- name: EPDSERVE_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ default (printf "%s-secret" (include "epdserve.fullname" .)) .Values.secret.existingSecret }}
      key: {{ .Values.secret.key }}
{{- end }}
