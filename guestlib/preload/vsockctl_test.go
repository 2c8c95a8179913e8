package preload

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/internal/proto"
)

// TestCControlVsockUnreachable: the C core asked for its control channel
// over vsock (SHUNT_CONTROL=vsock, Go's guestlib.VsockControl) where no
// hostd serves it (no vsock here at all, or a host whose port 1021 nobody
// serves) fails the open within its bounds (a 2 s vsock connect, 5 s for
// WELCOME), tries nothing else (the Unix socket "vsock" is not looked
// for), and says where it looked: CID 2 and Go's
// proto.VsockControlPort, so the two libraries' ports cannot drift apart.
// The channel over vsock itself is integration/vsock's
// TestVsockPreloadControl (a VM whose hostd serves it).
func TestCControlVsockUnreachable(t *testing.T) {
	bin := xtest(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "session", guestlib.VsockControl)
	cmd.Dir = t.TempDir() // no file named "vsock" where it runs
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("the session's open did not end within 30 s:\n%s", out)
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("shunt-xtest session vsock: %v, want exit 1 (no channel)\n%s", err, out)
	}
	want := fmt.Sprintf("shunt: hostd unreachable over vsock (CID 2 port %d): ", proto.VsockControlPort)
	if !strings.Contains(string(out), want) || !strings.Contains(string(out), "connections stay on TCP (no-hostd)") {
		t.Fatalf("the core's log does not say %q ... (no-hostd):\n%s", want, out)
	}
	t.Logf("%s", strings.TrimSpace(string(out)))
}
