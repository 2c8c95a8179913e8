package kubernetes

import (
	"bytes"
	"errors"
	"io"
	"os"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/shuntnet/shunt/container/cdi"
	"github.com/shuntnet/shunt/hostd/config"
)

type manifest struct {
	Kind string `yaml:"kind"`
	Data map[string]string
	Spec struct {
		Template struct {
			Spec struct {
				HostNetwork    bool        `yaml:"hostNetwork"`
				HostPID        bool        `yaml:"hostPID"`
				InitContainers []container `yaml:"initContainers"`
				Containers     []container
				Volumes        []struct {
					Name     string
					HostPath struct{ Path string } `yaml:"hostPath"`
				}
			}
		}
	}
}

type container struct {
	Name            string
	Args            []string
	SecurityContext struct{ Privileged bool } `yaml:"securityContext"`
	VolumeMounts    []struct {
		Name      string
		MountPath string `yaml:"mountPath"`
	} `yaml:"volumeMounts"`
}

// TestKubernetesManifest: hostd.hcl in the ConfigMap is a valid
// configuration with the container socket the CDI spec names, and the
// DaemonSet runs hostd privileged in the node's network and pid
// namespaces with /run/shunt, /dev/shm and the pods' namespaces.
func TestKubernetesManifest(t *testing.T) {
	b, err := os.ReadFile("hostd.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var cm, ds *manifest
	dec := yaml.NewDecoder(bytes.NewReader(b))
	for {
		var m manifest
		if err := dec.Decode(&m); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		switch m.Kind {
		case "ConfigMap":
			cm = &m
		case "DaemonSet":
			ds = &m
		}
	}
	if cm == nil || ds == nil {
		t.Fatal("hostd.yaml: want a ConfigMap and a DaemonSet")
	}
	cfg, err := config.Parse("hostd.hcl", []byte(cm.Data["hostd.hcl"]))
	if err != nil {
		t.Fatalf("the ConfigMap's hostd.hcl: %v", err)
	}
	if cfg.ContainerSocket != cdi.DefaultSocket {
		t.Errorf("container_socket %q, want %q (the CDI spec's)", cfg.ContainerSocket, cdi.DefaultSocket)
	}
	spec := ds.Spec.Template.Spec
	if !spec.HostNetwork || !spec.HostPID || len(spec.Containers) != 1 || !spec.Containers[0].SecurityContext.Privileged {
		t.Errorf("the DaemonSet must run hostd privileged with hostNetwork and hostPID: %+v", spec)
	}
	mounts := map[string]bool{}
	for _, m := range spec.Containers[0].VolumeMounts {
		mounts[m.MountPath] = true
	}
	for _, p := range []string{"/run/shunt", "/dev/shm", "/run/netns", "/var/run/netns", "/etc/shunt"} {
		if !mounts[p] {
			t.Errorf("hostd's container does not mount %s", p)
		}
	}
	if len(spec.InitContainers) != 1 || !slices.ContainsFunc(spec.InitContainers[0].Args, func(a string) bool {
		return strings.Contains(a, "/host/opt/cni/bin/shunt") && strings.Contains(a, "hostd cdi")
	}) {
		t.Errorf("the init container must install the CNI plugin and write the CDI spec")
	}
}
