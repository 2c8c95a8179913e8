package config_test

import (
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/config"
)

// container_socket needs a directory of its own: the CDI device mounts it
// into containers whole, so the admin or metrics socket beside it would be
// in every container.
func TestContainerSocket(t *testing.T) {
	for _, c := range []struct {
		line, want string // want "" = accepted
	}{
		{`container_socket = "/run/shunt/container/control.sock"`, ""},
		{`container_socket = "/run/shunt/c.sock"`, "directory of admin_socket"},
		{`container_socket = "/run/c.sock"`, "a directory of its own"},
		{`container_socket = "relative.sock"`, "absolute"},
		{"metrics_address = \"unix:/run/m/metrics.sock\"\ncontainer_socket = \"/run/m/c.sock\"", "directory of metrics_address"},
	} {
		src := "admin_socket = \"/run/shunt/admin.sock\"\n" + c.line + "\ntrust_group \"t\" {\n}\n"
		cfg, err := config.Parse("t.hcl", []byte(src))
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: %v", c.line, err)
		case c.want == "" && cfg.ContainerSocket != "/run/shunt/container/control.sock":
			t.Errorf("%s: ContainerSocket %q", c.line, cfg.ContainerSocket)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: %v, want an error saying %q", c.line, err, c.want)
		}
	}
}
