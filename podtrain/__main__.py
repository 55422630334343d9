from podtrain.cli import main

raise SystemExit(main())
