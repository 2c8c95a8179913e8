package mark

import (
	"testing"

	"go.uber.org/goleak"
)

// The keeper is the package's only goroutine: Close must stop it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
