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
{{- if and (hasKey $sc "runAsGroup") (eq (int $sc.runAsGroup) 0) -}}
{{- $why = append $why (printf "%s.runAsGroup 0 is root's group: use a non-zero gid (the image's is 10001)" $name) -}}
{{- end -}}
{{- if $sc.seccompProfile -}}
{{- if eq (toString $sc.seccompProfile.type) "Unconfined" -}}
{{- $why = append $why (printf "%s.seccompProfile.type Unconfined turns the syscall filter off: use RuntimeDefault" $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (hasKey .Values.podSecurityContext "fsGroup") (eq (int .Values.podSecurityContext.fsGroup) 0) -}}
{{- $why = append $why "podSecurityContext.fsGroup 0 gives root's group the pod's volumes: use a non-zero gid (the image's is 10001)" -}}
{{- end -}}
{{- if ne (toString .Values.securityContext.readOnlyRootFilesystem) "true" -}}
{{- $why = append $why "securityContext.readOnlyRootFilesystem must be true (the sidecar writes nothing but its volumes)" -}}
{{- end -}}
{{- $caps := default dict .Values.securityContext.capabilities -}}
{{- if $caps.add -}}
{{- $why = append $why (printf "securityContext.capabilities.add %v: kvferry needs no capability; keep drop: [ALL] alone" $caps.add) -}}
{{- end -}}
{{- if not (has "ALL" (default list $caps.drop)) -}}
{{- $why = append $why "securityContext.capabilities.drop must hold ALL" -}}
{{- end -}}
{{- range $k, $v := .Values.podAnnotations -}}
{{- if and (hasPrefix "container.apparmor.security.beta.kubernetes.io/" $k) (eq (toString $v) "unconfined") -}}
{{- $why = append $why (printf "podAnnotations %s: unconfined turns AppArmor off: leave it to the runtime default" $k) -}}
{{- end -}}
{{- end -}}
{{- if .Values.sharedMemory.enabled -}}
{{- $mp := toString .Values.sharedMemory.mountPath -}}
{{- if or (not (regexMatch "^/[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$" $mp)) (regexMatch "(^|/)\\.\\.?(/|$)" $mp) (regexMatch "^/(etc|bin|sbin|usr|lib|lib64|proc|sys|dev|var|run|boot|root|home|tmp|opt|srv|maps)(/|$)" $mp) -}}
{{- $why = append $why (printf "sharedMemory.mountPath %q must be a plain absolute path of its own (no '..', not a system folder such as /etc, not the sidecar's /maps or inside it): e.g. /kvferry-shm" $mp) -}}
{{- end -}}
{{- $size := toString .Values.sharedMemory.sizeLimit -}}
{{- $m := regexFind "^[0-9]{1,6}(Mi|Gi)$" $size -}}
{{- if not $m -}}
{{- $why = append $why (printf "sharedMemory.sizeLimit %q must be a size in Mi or Gi (e.g. 2Gi)" $size) -}}
{{- else -}}
{{- $mi := int (trimSuffix "Mi" (trimSuffix "Gi" $size)) -}}
{{- if hasSuffix "Gi" $size -}}{{- $mi = mul $mi 1024 -}}{{- end -}}
{{- if gt $mi 65536 -}}
{{- $why = append $why (printf "sharedMemory.sizeLimit %s is more than 64Gi: it counts against the pod's memory; size it to the answers in use plus the idle files (values.yaml)" $size) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* The security contexts are an allowlist: only fields the restricted Pod Security Standard permits, with values
it permits; anything else is refused by name (a denylist misses new fields). */ -}}
{{- $containerFields := list "allowPrivilegeEscalation" "capabilities" "privileged" "readOnlyRootFilesystem" "runAsNonRoot" "runAsUser" "runAsGroup" "seccompProfile" "appArmorProfile" "seLinuxOptions" "procMount" -}}
{{- $podFields := list "runAsNonRoot" "runAsUser" "runAsGroup" "fsGroup" "fsGroupChangePolicy" "seccompProfile" "appArmorProfile" "seLinuxOptions" "supplementalGroups" "sysctls" -}}
{{- $safeSysctls := list "kernel.shm_rmid_forced" "net.ipv4.ip_local_port_range" "net.ipv4.ip_unprivileged_port_start" "net.ipv4.tcp_syncookies" "net.ipv4.ping_group_range" "net.ipv4.ip_local_reserved_ports" "net.ipv4.tcp_keepalive_time" "net.ipv4.tcp_fin_timeout" "net.ipv4.tcp_keepalive_intvl" "net.ipv4.tcp_keepalive_probes" -}}
{{- $seLinuxTypes := list "" "container_t" "container_init_t" "container_kvm_t" "container_engine_t" -}}
{{- range $name, $pair := dict "securityContext" (list .Values.securityContext $containerFields) "podSecurityContext" (list .Values.podSecurityContext $podFields) -}}
{{- $sc := index $pair 0 -}}
{{- range $k, $v := $sc -}}
{{- if not (has $k (index $pair 1)) -}}
{{- $why = append $why (printf "%s.%s is not allowed: the chart renders only the fields the restricted Pod Security Standard permits (%s)" $name $k (join ", " (index $pair 1))) -}}
{{- end -}}
{{- end -}}
{{- with $sc.appArmorProfile -}}
{{- if not (has (toString .type) (list "RuntimeDefault" "Localhost")) -}}
{{- $why = append $why (printf "%s.appArmorProfile.type %q turns AppArmor off or is unknown: use RuntimeDefault (or Localhost)" $name (toString .type)) -}}
{{- end -}}
{{- end -}}
{{- with $sc.seLinuxOptions -}}
{{- if or .user .role (not (has (toString (default "" .type)) $seLinuxTypes)) -}}
{{- $why = append $why (printf "%s.seLinuxOptions may set only level and a container type (container_t, container_init_t, container_kvm_t, container_engine_t), never user or role: %v" $name .) -}}
{{- end -}}
{{- end -}}
{{- if and (hasKey $sc "procMount") (ne (toString $sc.procMount) "Default") -}}
{{- $why = append $why (printf "%s.procMount %q unmasks /proc: only Default is allowed" $name (toString $sc.procMount)) -}}
{{- end -}}
{{- end -}}
{{- range $g := default list .Values.podSecurityContext.supplementalGroups -}}
{{- if eq (int $g) 0 -}}
{{- $why = append $why "podSecurityContext.supplementalGroups holds 0, root's group: use non-zero gids" -}}
{{- end -}}
{{- end -}}
{{- range $s := default list .Values.podSecurityContext.sysctls -}}
{{- if not (has (toString $s.name) $safeSysctls) -}}
{{- $why = append $why (printf "podSecurityContext.sysctls %q is outside the safe set the restricted profile allows (%s)" (toString $s.name) (join ", " $safeSysctls)) -}}
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
{{- if or (regexMatch "^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*:[^/?#]*@" .Values.redis.url) (regexMatch "(?i)[?&][^=&]*(pass|user|secret|token|auth)[^=&]*=" .Values.redis.url) -}}
{{- $why = append $why "redis.url carries a credential (user:password@ or a password/username parameter), which would land in plaintext in the ConfigMap: put it in redis.password or redis.existingSecret" -}}
{{- end -}}
{{- if or (contains "#" .Values.redis.url) (regexMatch "[?].*%" .Values.redis.url) (regexMatch "^[a-z+]+://[^/?]*/[^?]*[^0-9/?]" .Values.redis.url) -}}
{{- $why = append $why "redis.url is not of the shape redis://host:port/db[?parameter=value]: a '#', a percent-encoded query parameter or a path that is not a database number is refused (the store's client would read a credential or another host there); put a password in redis.password or redis.existingSecret" -}}
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
