{{/*
Unsafe combinations the schema cannot see. Each fails the install with the fix, unless allowInsecure is true.
Included once, from deployment.yaml.
*/}}
{{- define "kvferry.validate" -}}
{{- $why := list -}}
{{- $hasAuth := or .Values.auth.existingSecret .Values.auth.mtlsTenant -}}
{{- if and (has .Values.service.type (list "LoadBalancer" "NodePort")) (not (and $hasAuth .Values.tls.enabled)) -}}
{{- $why = append $why (printf "service.type %s exposes the sidecar outside the cluster: set tls.enabled and auth.existingSecret (or auth.mtlsTenant), or use ClusterIP" .Values.service.type) -}}
{{- end -}}
{{- range $name, $sc := dict "securityContext" .Values.securityContext "podSecurityContext" .Values.podSecurityContext -}}
{{- if not $sc.runAsNonRoot -}}
{{- $why = append $why (printf "%s.runAsNonRoot must be true" $name) -}}
{{- end -}}
{{- if and (hasKey $sc "runAsUser") (eq (int $sc.runAsUser) 0) -}}
{{- $why = append $why (printf "%s.runAsUser 0 runs as root: use a non-zero uid (the image's is 10001)" $name) -}}
{{- end -}}
{{- end -}}
{{- if .Values.securityContext.privileged -}}
{{- $why = append $why "securityContext.privileged must not be true (kvferry needs no host access)" -}}
{{- end -}}
{{- if ne (toString .Values.securityContext.allowPrivilegeEscalation) "false" -}}
{{- $why = append $why "securityContext.allowPrivilegeEscalation must be false" -}}
{{- end -}}
{{- $limits := default dict .Values.resources.limits -}}
{{- if not (and $limits.cpu $limits.memory) -}}
{{- $why = append $why "resources.limits.cpu and resources.limits.memory must be set (a translate burst would otherwise take the node)" -}}
{{- end -}}
{{- if eq .Values.mode "podSidecar" -}}
{{- $msLimits := default dict (default dict .Values.modelServer.resources).limits -}}
{{- if not $msLimits.memory -}}
{{- $why = append $why "modelServer.resources.limits.memory must be set in podSidecar mode" -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.maps.source "url") (hasPrefix "http://" .Values.maps.url.href) -}}
{{- $why = append $why "maps.url.href is plain http: anyone on the path could swap the maps; use https" -}}
{{- end -}}
{{- if regexMatch "^rediss?://[^/@]*:[^/@]*@" .Values.redis.url -}}
{{- $why = append $why "redis.url carries a password, which would land in plaintext in the ConfigMap: put it in redis.password or redis.existingSecret" -}}
{{- end -}}
{{- if and .Values.redis.writeBack (not $hasAuth) -}}
{{- $why = append $why "redis.writeBack without auth lets any caller publish prefixes every caller reads (SECURITY.md): set auth.existingSecret or auth.mtlsTenant" -}}
{{- end -}}
{{- if .Values.sidecar.forceMaps -}}
{{- $why = append $why "sidecar.forceMaps serves maps whose evidence fails the gates: testing only" -}}
{{- end -}}
{{- if and $why (not .Values.allowInsecure) -}}
{{- fail (printf "unsafe values (set allowInsecure: true only for a throwaway test cluster):\n  - %s" (join "\n  - " $why)) -}}
{{- end -}}
{{- end -}}
